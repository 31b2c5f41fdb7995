"""Activation-recompute flags as Megatron-LM core_v0.19.0 reads them (flags/recompute.py):
--recompute-activations means selective, full needs a method and a layer count, selective
takes neither, and --recompute-modules picks what selective recompute checkpoints; a run
recomputing the dense modules trains the same losses, bitwise (the MoE ones:
tests/unit_tests/models/moe/test_moe_layer.py)."""

from __future__ import annotations

import pytest
from torch.utils.checkpoint import checkpoint

from megatron.core.transformer import recompute
from megatron.training.flags import recompute as recompute_flags
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_transformer_config, resolved_flags
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain


def _config(extra: list[str]):
    args = parse_args(TINY_GPT + extra, world_size=1)
    config = build_transformer_config(args, vocab_size=512)
    notes = resolved_flags(args, world_size=1).megatron_lm_notes
    return (config.recompute_granularity, tuple(config.recompute_modules)), notes


@pytest.mark.parametrize(
    "extra, want",
    [
        ([], (None, ("core_attn",))),
        (["--recompute-activations"], ("selective", ("core_attn",))),
        (["--recompute-granularity", "selective"], ("selective", ("core_attn",))),
        (
            ["--recompute-activations", "--recompute-modules", "mlp", "moe", "shared_experts"],
            ("selective", ("mlp", "moe", "shared_experts")),
        ),
        (["--moe-layer-recompute"], ("selective", ("core_attn", "moe"))),
        (
            ["--moe-layer-recompute", "--recompute-modules", "moe", "mlp"],
            ("selective", ("moe", "mlp")),
        ),
    ],
)
def test_selective_recompute_flags_build_the_megatron_lm_config(extra, want):
    got, notes = _config(extra)
    assert got == want
    assert not [n for n in notes if "recompute" in n]


def test_recompute_activations_replaces_full_with_a_note():
    # Megatron-LM: `if args.recompute_activations: args.recompute_granularity = 'selective'`.
    full = ["--recompute-granularity", "full", "--recompute-method", "block"]
    # The method is checked against the granularity the flags mean (selective): refused.
    with pytest.raises(SystemExit):
        parse_args(TINY_GPT + ["--recompute-activations", *full], world_size=1)
    got, notes = _config(["--recompute-activations", "--recompute-granularity", "full"])
    assert got == ("selective", ("core_attn",))
    assert [n for n in notes if "recompute" in n] == [
        "--recompute-activations sets --recompute-granularity selective over the given full, "
        "as Megatron-LM does."
    ]


def test_full_recompute_takes_the_given_method_and_layers():
    args = parse_args(
        TINY_GPT
        + ["--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "2"],
        world_size=1,
    )
    config = build_transformer_config(args, vocab_size=512)
    assert (config.recompute_granularity, config.recompute_method) == ("full", "block")
    assert config.recompute_num_layers == 2


FULL = ["--recompute-granularity", "full"]
ZERO3_MXFP8 = ["--bf16", "--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
ZERO3_MXFP8 += ["optim_grads_params", "--fp8-recipe", "mxfp8", "--fp8-param-gather"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            FULL + ["--recompute-num-layers", "1"],
            "--recompute-granularity full needs --recompute-method uniform or block (as in "
            "Megatron-LM); add one.",
        ),
        (
            FULL + ["--recompute-method", "uniform"],
            "--recompute-granularity full needs --recompute-num-layers of at least 1 (as in "
            "Megatron-LM; given None).",
        ),
        (
            FULL + ["--recompute-method", "block", "--recompute-num-layers", "0"],
            "--recompute-granularity full needs --recompute-num-layers of at least 1 (as in "
            "Megatron-LM; given 0).",
        ),
        (
            FULL + ["--moe-layer-recompute"],
            "--moe-layer-recompute goes with selective recompute, not --recompute-granularity "
            "full (as in Megatron-LM); drop one.",
        ),
        (
            ["--recompute-activations", "--recompute-num-layers", "1"],
            "--recompute-num-layers 1 goes with --recompute-granularity full, not selective "
            "(as in Megatron-LM); drop it or recompute full layers.",
        ),
        (
            ["--recompute-activations", "--recompute-modules"],
            "argument --recompute-modules: expected at least one argument",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "mlp", *ZERO3_MXFP8],
            "--recompute-modules mlp with --fp8-recipe mxfp8 FP8 parameters under "
            "--data-parallel-sharding-strategy optim_grads_params is not built: the recompute "
            "would read the forward weight copy the engine released after forward; recompute "
            "core_attn only, use --recompute-granularity full, or the optim_grads strategy.",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "core_attn", "layernorm"],
            "--recompute-modules layernorm (Megatron-LM's recompute that drops the norm output "
            "after the next Linear runs) is not built; pick from core_attn mlp moe "
            "shared_experts.",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "attn"],
            "--recompute-modules attn is not a recompute module; pick from core_attn mlp moe "
            "shared_experts.",
        ),
    ],
)
def test_recompute_refusals_name_the_fix(extra, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_GPT + extra, world_size=1)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("error:") == 1
    assert f"error: {message}\n" in err, err


def test_modules_without_selective_are_ignored_as_in_megatron_lm():
    # Megatron-LM validates --recompute-modules only with selective granularity, and the full
    # recompute's method and layer count only with a granularity.
    got, notes = _config(["--recompute-modules", "layernorm"])
    assert got == (None, ("core_attn",)) and not [n for n in notes if "recompute" in n]
    got, notes = _config(["--recompute-method", "uniform", "--recompute-num-layers", "2"])
    assert got == (None, ("core_attn",))
    assert [n for n in notes if "recompute" in n] == [
        f"{flag} without --recompute-granularity: ignored (no activation recompute), as in "
        "Megatron-LM."
        for flag in ("--recompute-method", "--recompute-num-layers")
    ]
    # The forward copy is released under ZeRO-3 with mxfp8 only: the other recipes, ZeRO-2 and
    # core_attn alone are built.
    mlp = ["--recompute-activations", "--recompute-modules", "mlp"]
    tensorwise = [a if a != "mxfp8" else "tensorwise" for a in ZERO3_MXFP8]
    assert _config(mlp + tensorwise)[0] == ("selective", ("mlp",))
    zero2 = [a if a != "optim_grads_params" else "optim_grads" for a in ZERO3_MXFP8]
    assert _config(mlp + zero2)[0] == ("selective", ("mlp",))
    assert _config(["--recompute-activations", *ZERO3_MXFP8])[0] == ("selective", ("core_attn",))


def test_recomputing_the_dense_modules_trains_the_same_losses(monkeypatch):
    base = [*TINY_GPT, *NO_DROPOUT, "--swiglu", "--train-iters", "4"]
    plain = run_pretrain(base).losses
    checkpointed = []

    def counting(function, *args, **kwargs):
        checkpointed.append(type(function).__name__)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counting)
    recomputed = run_pretrain(
        base + ["--recompute-activations", "--recompute-modules", "core_attn", "mlp"]
    ).losses
    assert len(plain) == 4 and recomputed == plain
    # 4 steps x 4 micro-batches (8 samples of 2) x 2 layers, each its MLP and attention core;
    # evaluation runs without grad, so without checkpoint.
    assert sorted(set(checkpointed)) == ["MLP", "function"]
    assert (checkpointed.count("MLP"), checkpointed.count("function")) == (32, 32)


DELAYED = ["--bf16", "--fp8-format", "hybrid"]  # --fp8-format alone: delayed scaling
EAGER = recompute_flags.EAGER_NOTE
MOE_EAGER = EAGER.format("moe", recompute_flags.EAGER_REASONS["moe"])


@pytest.mark.parametrize(
    "extra, compiled, want",
    [
        (["moe"], True, [MOE_EAGER]),
        (["moe"], False, []),
        (["shared_experts", "core_attn"], True, []),
        (["mlp", "shared_experts", *DELAYED], True, [
            EAGER.format("mlp shared_experts", recompute_flags.EAGER_REASONS["delayed"])
        ]),
        (["moe", "mlp", *DELAYED, "--fp8-recipe", "tensorwise"], True, [MOE_EAGER]),
    ],
)  # fmt: skip
def test_a_compiled_run_says_which_recomputed_modules_run_eager(extra, compiled, want):
    from tests.unit_tests.training.test_moe_training import TINY_MOE

    compile_flag = "--torch-compile" if compiled else "--no-torch-compile"
    argv = [*TINY_MOE, "--recompute-activations", "--recompute-modules", *extra, compile_flag]
    notes = resolved_flags(parse_args(argv, world_size=1), world_size=1).megatron_lm_notes
    assert [n for n in notes if n.startswith("--recompute-modules")] == want
