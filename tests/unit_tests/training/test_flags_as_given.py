"""parse_args leaves the flags as given; the values derived from them (configs.resolved_flags)
live in the typed configs and in metadata.json's "resolved_args", and a checkpoint from before
that split, whose "args" hold the resolved values, still loads and is still checked."""

from __future__ import annotations

import json

import pytest

from megatron.training.checkpoint import CheckpointError
from megatron.training.flags.arguments import build_parser, parse_args
from megatron.training.flags.configs import build_run_config, resolved_flags
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain
from tests.unit_tests.training.test_megatron_lm_cmdlines import COMMAND_LINES, argv_of

# Each writes at least one derived value that parse-time code used to store in the Namespace.
DERIVING_LINES = {
    "defaults": [],
    "distributed optimizer": ["--use-distributed-optimizer"],
    "fp8 format alone": ["--fp8-format", "hybrid"],
    "quoted split, sequence parallel": ["--split", "'99,1,0'", "--sequence-parallel"],
    "train samples": ["--train-samples", "100", "--lr-warmup-samples", "16"],
    "wandb under save": ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "{tmp}/ck"],
    "fsdp dtypes": [
        "--bf16",
        "--use-megatron-fsdp",
        "--megatron-fsdp-main-grads-dtype",
        "auto",
        "--megatron-fsdp-grad-comm-dtype",
        "bf16",
    ],
}


@pytest.mark.parametrize("name", [*DERIVING_LINES, *COMMAND_LINES])
def test_parse_args_leaves_the_namespace_as_argparse_parses_it(name, tmp_path):
    if name in DERIVING_LINES:
        argv = [word.format(tmp=tmp_path) for word in TINY_GPT + DERIVING_LINES[name]]
    else:
        argv = argv_of(COMMAND_LINES[name], tmp_path)
    assert vars(parse_args(argv, world_size=1)) == vars(build_parser().parse_args(argv))


def test_derived_values_live_in_the_configs():
    argv = TINY_GPT + ["--use-distributed-optimizer", "--fp8-format", "hybrid"]
    argv += ["--train-samples", "100", "--split", "'99,1,0'"]
    args = parse_args(argv, world_size=2)
    assert (args.global_batch_size, args.train_iters, args.max_position_embeddings) == (
        8,
        None,
        None,
    )
    run = build_run_config(args, world_size=2)
    assert (run.training.global_batch_size, run.training.train_iters) == (8, 12)  # 100 // 8
    assert (run.training.num_microbatches, run.data.split) == (2, "99,1,0")
    assert run.model_template.max_sequence_length == 32
    assert (
        run.model_template.fp8.recipe == "delayed" and run.model_template.fp8.fp8_format == "hybrid"
    )
    assert run.model_setup.fsdp.data_parallel_sharding_strategy == "optim"
    assert (run.checkpoint.ckpt_format, run.distributed.use_megatron_fsdp) == ("torch_dist", True)
    assert run.logging.notes[-1].startswith("--use-distributed-optimizer: main params")
    given, resolved = run.checkpoint.saved_args, run.checkpoint.resolved_args
    assert (given["use_megatron_fsdp"], given["fp8_recipe"], given["train_iters"]) == (
        False,
        None,
        None,
    )
    assert (resolved["use_megatron_fsdp"], resolved["fp8_recipe"], resolved["train_iters"]) == (
        True,
        "delayed",
        12,
    )
    assert (resolved["world_size"], resolved["data_parallel_size"]) == (2, 2)
    assert vars(resolved_flags(args, world_size=2))["ckpt_format"] == "torch_dist"


def test_a_checkpoint_whose_args_hold_resolved_values_still_loads(tmp_path):
    """Before the split metadata.json's "args" held the resolved values (Megatron-LM's way):
    the engine check and the delayed-scaling state still find them there."""
    base = TINY_GPT + NO_DROPOUT + ["--fp8-format", "hybrid", "--use-distributed-optimizer"]
    base += ["--lr-decay-iters", "3"]  # the resume to 3 iterations keeps the schedule
    run_pretrain(base + ["--train-iters", "2", "--save", str(tmp_path)])
    path = tmp_path / "iter_0000002" / "metadata.json"
    metadata = json.loads(path.read_text())
    given, resolved = metadata["args"], metadata["resolved_args"]
    assert (given["use_megatron_fsdp"], given["fp8_recipe"], given["ckpt_format"]) == (
        False,
        None,
        None,
    )
    assert (resolved["use_megatron_fsdp"], resolved["fp8_recipe"]) == (True, "delayed")
    assert (resolved["ckpt_format"], resolved["num_microbatches"]) == ("torch_dist", 4)
    metadata["args"] = {**given, **metadata.pop("resolved_args")}  # as an older run wrote it
    path.write_text(json.dumps(metadata))

    ddp = TINY_GPT + NO_DROPOUT + ["--fp8-format", "hybrid", "--ckpt-format", "torch_dist"]
    with pytest.raises(CheckpointError) as info:
        run_pretrain(ddp + ["--train-iters", "3", "--load", str(tmp_path)])
    assert "a --fp8-recipe delayed checkpoint saved with --use-megatron-fsdp" in str(info.value)
    assert sorted(run_pretrain(base + ["--train-iters", "3", "--load", str(tmp_path)]).losses) == [
        3
    ]
    # --use-checkpoint-args takes the model flags, rows and format from the old "args" too.
    args = parse_args(
        TINY_GPT + ["--num-layers", "3", "--load", str(tmp_path), "--use-checkpoint-args"]
    )
    flags = resolved_flags(args, world_size=1)
    assert (args.num_layers, flags.padded_vocab_size, flags.ckpt_format) == (2, 512, "torch_dist")
