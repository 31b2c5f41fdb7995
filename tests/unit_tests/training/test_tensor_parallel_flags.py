"""Issue 40, acceptance 6: bad tensor-parallel layouts stop at parse time with exit 2 and one
line naming the fix; pipeline/context parallelism, --tp-comm-overlap and expert tensor
parallelism stay refused in the one not-built message."""

from __future__ import annotations

import pytest

from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_run_config
from tests.unit_tests.training.common import TINY_GPT

# TINY_GPT: 4 heads, hidden 64 (FFN 256), seq 32, vocab 512.


def _tp(n: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(n)]


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        (_tp(2), 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
        (_tp(8), 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
        (
            _tp(4) + ["--group-query-attention", "--num-query-groups", "2"],
            4,
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4; pick a "
            "tensor-parallel size dividing 2.",
        ),
        (
            _tp(2) + ["--ffn-hidden-size", "99"],
            2,
            "--ffn-hidden-size 99 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            _tp(4) + ["--sequence-parallel", "--seq-length", "30"],
            4,
            "--seq-length 30 is not divisible by --tensor-model-parallel-size 4 with "
            "--sequence-parallel; pick a sequence length that is a multiple of 4",
        ),
        (_tp(0), 1, "--tensor-model-parallel-size 0 must be at least 1."),
        (_tp(2), 1, "world size 1 is not divisible by --tensor-model-parallel-size 2"),
        (
            _tp(2) + ["--use-torch-fsdp2"],
            2,
            "--tensor-model-parallel-size > 1 is not built yet with: --use-torch-fsdp2 (use "
            "Megatron-FSDP or torch DDP)",
        ),
        (
            _tp(2) + ["--ckpt-format", "torch", "--save", "/x"],
            2,
            "not built yet with: --ckpt-format torch (one file set of one rank's shards) (use "
            "--ckpt-format torch_dist, which holds the full tensors)",
        ),
        (
            _tp(2) + ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2"],
            2,
            "--num-distributed-optimizer-instances 2 does not divide the data-parallel size 1",
        ),
        (_tp(2) + ["--fp8-recipe", "tensorwise"], 2, "add --use-megatron-fsdp --fp8-param-gather"),
        (
            _tp(2) + ["--disable-bias-linear", "--num-experts", "4"],
            2,
            "not built these Megatron-LM features: --tensor-model-parallel-size 2 with "
            "--num-experts",
        ),
        (_tp(2) + ["--qk-layernorm"], 2, "not built yet with: --qk-layernorm (use no QK norm)"),
        (_tp(2) + ["--mtp-num-layers", "1"], 2, "not built yet with: --mtp-num-layers"),
    ],
)
def test_bad_tensor_parallel_layouts_exit_2(extra, world_size, expected, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_GPT + extra, world_size=world_size)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("error:") == 1
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_unbuilt_parallelism_is_refused_in_one_message(capsys) -> None:
    extra = _tp(2) + [
        "--pipeline-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--tp-comm-overlap",
        "--expert-tensor-parallel-size",
        "2",
    ]
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_GPT + extra, world_size=8)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    for flag in (
        "--pipeline-model-parallel-size 2",
        "--context-parallel-size 2",
        "--tp-comm-overlap (userbuffers)",
        "--expert-tensor-parallel-size 2",
    ):
        assert flag in err
    assert "--tensor-model-parallel-size 2 (use" not in err  # built: not in the list


def test_tensor_parallel_flags_reach_the_run_config() -> None:
    args = parse_args(TINY_GPT + _tp(2) + ["--sequence-parallel"], world_size=4)
    config = build_run_config(args, world_size=4)
    assert config.distributed.tensor_model_parallel_size == 2
    assert config.distributed.sequence_parallel is True
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP.
    assert config.make_vocab_size_divisible_by == 256
    assert config.model_config(vocab_size=300).vocab_size == 512
    # The global batch defaults to micro-batch x data-parallel size (world / TP).
    assert args.global_batch_size == 8
    default_batch = [a for a in TINY_GPT if a not in ("--global-batch-size", "8")]
    args = parse_args(default_batch + _tp(2), world_size=4)
    assert build_run_config(args, world_size=4).training.global_batch_size == 2 * 2


def test_sequence_parallel_stays_off_at_tp_1() -> None:
    args = parse_args(TINY_GPT + ["--sequence-parallel"], world_size=2)
    assert build_run_config(args, world_size=2).distributed.sequence_parallel is False
