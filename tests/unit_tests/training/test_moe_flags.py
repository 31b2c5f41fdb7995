"""MoE flags: Megatron-LM's names and defaults, their TransformerConfig fields, and issue 38's
acceptance 7 (bad MoE input exits 2 before training with one line naming the flag and fix)."""

from __future__ import annotations

import argparse
import ast

import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.recipe import FP8_RECIPES
from megatron.core.transformer.moe.grouped_fp8 import grouped_path_applies
from megatron.training.flags.arguments import build_parser, parse_args
from megatron.training.flags.configs import build_run_config
from megatron.training.flags.megatron_lm_table import read_table
from megatron.training.flags.moe import MOE_CONFIG_FIELDS, moe_layer_freq

MOE = ["--mock-data", "--num-experts", "4", "--disable-bias-linear"]


def _error_line(argv: list[str], capsys, *, world_size: int = 1) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=world_size)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("(see ")  # one error line, one --help pointer
    return lines[0]


def test_defaults_are_megatron_lms():
    table = {flag: default for flag, _, default in read_table()}
    parser = build_parser()
    args = parser.parse_args([])
    flags = {f"--{dest.replace('_', '-')}" for dest in MOE_CONFIG_FIELDS.values()}
    assert len(flags) == 24
    for flag in sorted(flags):
        dest = parser._option_string_actions[flag].dest
        expected = ast.literal_eval(table[flag])
        assert getattr(args, dest) == expected, flag


def test_flags_reach_the_transformer_config():
    argv = MOE + [
        "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "([0]*1+[1]*1)",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
        "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.02",
        "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.5",
        "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
    ]  # fmt: skip
    config = build_run_config(parse_args(argv, world_size=4), world_size=4).model_template
    assert config.num_moe_experts == 4 and config.moe_ffn_hidden_size == 24
    assert config.moe_layer_freq == [0, 1]
    assert config.moe_shared_expert_intermediate_size == 32 and config.moe_shared_expert_gate
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_dtype == "fp64"
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.01
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert config.moe_aux_loss_coeff == 0.02 and config.moe_z_loss_coeff == 0.001
    assert config.moe_expert_capacity_factor == 1.5
    assert config.moe_token_drop_policy == "position" and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_dispatcher_type == "alltoall"
    assert config.expert_model_parallel_size == 2


def test_dense_default_has_no_experts():
    config = build_run_config(parse_args(["--mock-data"], world_size=1), world_size=1)
    assert config.model_template.num_moe_experts is None
    assert config.model_template.expert_model_parallel_size == 1


def test_layer_freq_patterns():
    assert moe_layer_freq("2") == 2
    assert moe_layer_freq("([0]*1+[1]*3)") == [0, 1, 1, 1]
    assert moe_layer_freq("[1,0]*2") == [1, 0, 1, 0]
    # Megatron-LM reads a text without "[" as int(text)
    assert [moe_layer_freq(text) for text in ("02", "+2", " 3 ")] == [2, 2, 3]
    for text in ("1+1", "2*2", "(3)"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither an int nor a list"):
            moe_layer_freq(text)


def test_permute_fusion_and_grouped_gemm_are_logged():
    argv = MOE + ["--moe-permute-fusion", "--moe-grouped-gemm"]
    notes = build_run_config(parse_args(argv, world_size=1), world_size=1).logging.notes
    assert sum(note.startswith("--moe-permute-fusion: accepted") for note in notes) == 1
    assert sum(note.startswith("--moe-grouped-gemm:") for note in notes) == 1


def _notes(argv: list[str]) -> list[str]:
    return list(build_run_config(parse_args(argv, world_size=1), world_size=1).logging.notes)


@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_experts_that_loop_under_an_fp8_recipe_are_logged(recipe, hidden):
    """The note follows grouped_fp8.grouped_path_applies, the one rule of which expert Linears
    run grouped, at the model's shapes: under mxfp8 an output dim that is not a multiple of 32
    (fc2's, the hidden size 48) loops; dense models, bf16 and --fp8-format alone get none."""
    shape = ["--hidden-size", str(hidden), "--num-attention-heads", "4"]
    loops = not grouped_path_applies(Fp8Config(recipe=recipe), torch.empty(1, hidden, 1))
    assert loops == (recipe == "mxfp8" and hidden == 48)  # the test sees both cases
    notes = [n for n in _notes(MOE + shape + ["--fp8-recipe", recipe]) if n.startswith("FP8 ")]
    assert [n.split(" run one")[0] for n in notes] == (
        [f"FP8 recipe {recipe} with --num-experts: the routed experts' fc2 (output dim 48)"]
        if loops
        else []
    )
    assert not [n for n in _notes(["--mock-data", "--fp8-recipe", recipe]) if "FP8 recipe" in n]
    for argv in (MOE, MOE + ["--fp8-format", "hybrid"]):
        assert not [n for n in _notes(argv + shape) if n.startswith("FP8 recipe ")]


# Acceptance 7: (extra argv, world size, words the one error line must contain)
BAD_MOE_INPUT = [
    (
        ["--expert-model-parallel-size", "3"],
        3,
        ["--num-experts 4", "--expert-model-parallel-size 3", "multiple"],
    ),
    (["--moe-router-topk", "5"], 1, ["--moe-router-topk 5", "1..--num-experts (4)"]),
    (
        ["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
        1,
        ["--moe-router-group-topk 3", "--moe-router-num-groups (2)"],
    ),
    (
        ["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
        1,
        ["--moe-router-topk 2 exceeds", "raise the group top-k"],
    ),
    (
        ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
        1,
        ["--moe-router-group-topk needs --moe-router-num-groups dividing --num-experts"],
    ),
    (
        ["--expert-model-parallel-size", "4"],
        2,
        ["--expert-model-parallel-size 4 must divide the data-parallel size (2 ranks)"],
    ),
    (
        ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "random"],
        1,
        ["--moe-token-drop-policy", "invalid choice: 'random'", "'probs', 'position'"],
    ),
    (
        ["--moe-expert-capacity-factor", "1.0", "--moe-router-load-balancing-type", "sinkhorn"],
        1,
        ["--moe-expert-capacity-factor", "change --moe-router-load-balancing-type"],
    ),
    (["--moe-expert-capacity-factor", "0"], 1, ["--moe-expert-capacity-factor 0.0 must be > 0"]),
    (
        ["--moe-pad-expert-input-to-capacity"],
        1,
        ["--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"],
    ),
    (["--moe-layer-freq", "[0,1,1]"], 1, ["--moe-layer-freq [0, 1, 1]", "2 in all"]),
    (
        ["--expert-model-parallel-size", "4", "--use-megatron-fsdp"]
        + ["--num-distributed-optimizer-instances", "2"],
        4,
        ["--expert-model-parallel-size 4 must divide the ranks of one HSDP replica (2 = 4 /"],
    ),
    (
        ["--moe-router-enable-expert-bias"],
        1,
        ["--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"],
    ),
    (
        ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
        1,
        ["--moe-router-load-balancing-type aux_loss seq_aux_loss", "give one"],
    ),
]


@pytest.mark.parametrize("extra, world_size, words", BAD_MOE_INPUT)
def test_bad_moe_input_exits_2_with_one_line(extra, world_size, words, capsys):
    line = _error_line(MOE + extra, capsys, world_size=world_size)
    for word in words:
        assert word in line, line


def test_experts_need_no_bias(capsys):
    line = _error_line(["--mock-data", "--num-experts", "4"], capsys)
    assert "add --disable-bias-linear" in line


def test_ep_without_experts(capsys):
    line = _error_line(["--mock-data", "--expert-model-parallel-size", "2"], capsys, world_size=2)
    assert "--expert-model-parallel-size > 1 needs --num-experts" in line


UNBUILT = [
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex"),
    (["--moe-enable-deepep"], "--moe-enable-deepep"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2"),
    (
        ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"],
        "--expert-model-parallel-size 2 with --use-torch-fsdp2",
    ),
    (
        ["--expert-model-parallel-size", "2", "--ckpt-format", "torch", "--save", "/tmp/never"],
        "--ckpt-format torch with --expert-model-parallel-size 2",
    ),
]


@pytest.mark.parametrize("extra, written", UNBUILT)
def test_unbuilt_moe_features_in_the_one_message(extra, written, capsys):
    line = _error_line(MOE + extra, capsys, world_size=4)
    assert line.startswith("pretrain_gpt.py: error: megatron-fp8 has not built these")
    assert written in line


@pytest.mark.parametrize("engine", [[], ["--use-megatron-fsdp"], ["--use-distributed-optimizer"]])
def test_expert_parallelism_is_built_for_ddp_and_megatron_fsdp(engine):
    argv = MOE + ["--expert-model-parallel-size", "2", *engine]
    config = build_run_config(parse_args(argv, world_size=4), world_size=4)
    assert config.distributed.expert_model_parallel_size == 2
    assert config.model_template.expert_model_parallel_size == 2


def test_expert_parallel_checkpoints_default_to_torch_dist():
    argv = MOE + ["--expert-model-parallel-size", "2", "--save", "/tmp/never-written"]
    config = build_run_config(parse_args(argv, world_size=4), world_size=4)
    assert config.checkpoint.ckpt_format == "torch_dist"


def test_unbuilt_features_are_named_together(capsys):
    extra = ["--moe-token-dispatcher-type", "flex", "--tensor-model-parallel-size", "2"]
    line = _error_line(MOE + extra, capsys, world_size=2)
    assert line.count("has not built") == 1
    assert "--moe-token-dispatcher-type flex" in line and "--tensor-model-parallel-size 2" in line
