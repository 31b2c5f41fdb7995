"""FP8 with tensor parallelism at parse time (issue 40): the recipes run with TP > 1, shapes
whose TP cut would split a block (blockwise 128) or MX (mxfp8 32) scale cell are refused with
exit 2 and one line naming the flags and the fix, and tensorwise needs FP8 weights
(Megatron-FSDP's --fp8-param-gather), whose scale is agreed over TP."""

from __future__ import annotations

import pytest

from megatron.training.flags.arguments import parse_args
from megatron.training.flags.tensor_parallel import check_fp8_tensor_parallel_split
from tests.unit_tests.training.common import TINY_GPT

# TINY_GPT: 4 heads, hidden 64 (kv-channels 16, FFN 256): at TP 2 the pieces are 32 and 128.
TP2_FSDP_FP8 = ["--tensor-model-parallel-size", "2", "--use-megatron-fsdp", "--fp8-param-gather"]
BLOCKWISE_OK = ["--hidden-size", "256", "--num-attention-heads", "2", "--ffn-hidden-size", "512"]


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("delayed", []),
        ("tensorwise", []),
        ("mxfp8", []),  # pieces 32 (heads) and 128 (FFN): whole 32-wide cells
        ("blockwise", BLOCKWISE_OK),  # pieces 128 and 256: whole 128-wide cells
    ],
)
def test_fp8_recipes_parse_with_tensor_parallel(recipe, extra) -> None:
    args = parse_args(TINY_GPT + TP2_FSDP_FP8 + ["--fp8-recipe", recipe] + extra, world_size=4)
    assert args.fp8_recipe == recipe and args.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        (
            ["--fp8-recipe", "blockwise"],
            4,
            "--fp8-recipe blockwise with --tensor-model-parallel-size 2: --num-attention-heads "
            "x kv-channels / TP = 32 is not a multiple of the 128-wide scale blocks",
        ),
        (
            ["--fp8-recipe", "mxfp8", "--ffn-hidden-size", "160"],
            4,
            "--fp8-recipe mxfp8 with --tensor-model-parallel-size 2: --ffn-hidden-size / TP = "
            "80 is not a multiple of the 32-wide scale blocks",
        ),
    ],
)
def test_fp8_block_straddling_a_tp_cut_exits_2(extra, world_size, expected, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_GPT + TP2_FSDP_FP8 + extra, world_size=world_size)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "a smaller TP size, or --fp8-recipe tensorwise/delayed" in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_tensorwise_with_tp_needs_fp8_weights(capsys) -> None:
    argv = TINY_GPT + ["--tensor-model-parallel-size", "2", "--fp8-recipe", "tensorwise"]
    with pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=2)
    assert info.value.code == 2
    assert "add --use-megatron-fsdp --fp8-param-gather" in capsys.readouterr().err


def test_split_check_names_the_first_piece_off_the_cell_grid() -> None:
    pieces = {"a": 256, "b": 96, "c": 7}
    assert check_fp8_tensor_parallel_split(0, pieces) is None  # per-tensor: no cells
    assert check_fp8_tensor_parallel_split(32, pieces) == "c = 7"
    assert check_fp8_tensor_parallel_split(128, pieces) == "b = 96"
    assert check_fp8_tensor_parallel_split(32, {"a": 64, "b": 96}) is None
