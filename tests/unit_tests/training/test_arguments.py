"""Flag list frozen; every invalid combination exits with status 2 and names the fix."""

import os
import subprocess
import sys

import pytest

from megatron.training.arguments import build_parser, parse_args
from tests.unit_tests.training.common import TINY_GPT

FROZEN = os.path.join(os.path.dirname(__file__), "frozen_flags.txt")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_flag_list_is_frozen():
    """Flags are a public interface: adding/removing one must update frozen_flags.txt."""
    parser = build_parser()
    flags = sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )
    with open(FROZEN) as handle:
        assert flags == handle.read().split()


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = build_parser().format_help()  # raises on a stray % in any help string
    assert text.count("\n  --") >= 85 and "Exit when iteration % N == 0." in text


def parse_error(argv, capsys, world_size=1) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=world_size)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        (["--global-batch-size", "7"], 1, "--global-batch-size 7 is not a multiple of"),
        (["--global-batch-size", "8"], 3, "data-parallel size 3 = 6"),
        (["--hidden-size", "66"], 1, "not divisible by --num-attention-heads"),
        (["--group-query-attention"], 1, "needs --num-query-groups"),
        (["--group-query-attention", "--num-query-groups", "3"], 1, "not a multiple of"),
        (["--fp8-format", "e5m2", "--fp8-recipe", "tensorwise"], 1, "E5M2 alone is not allowed"),
        (["--fp8-recipe", "blockwise", "--hidden-size", "72", "--num-attention-heads", "4"],
         1, "--hidden-size 72 is not divisible by 16"),
        (["--fp8-recipe", "mxfp8", "--ffn-hidden-size", "200"], 1,
         "--ffn-hidden-size 200 is not divisible by 16"),
        (["--fp8-recipe", "fp4"], 1, "invalid choice: 'fp4'"),
        (["--fp8-param-gather", "--fp8-recipe", "mxfp8"], 1, "add --use-megatron-fsdp"),
        (["--fp8-param-gather"], 1, "needs --fp8-recipe"),
        (["--overlap-param-gather"], 1, "is a Megatron-FSDP option"),
        (["--ckpt-format", "torch_dist"], 1, "add --use-megatron-fsdp"),
        (["--save-interval", "5"], 1, "needs --save"),
        (["--lr-decay-style", "WSD"], 1, "needs --lr-wsd-decay-iters"),
        (["--lr-warmup-iters", "200", "--train-iters", "100"], 1, "must be below --lr-decay-iters"),
        (["--min-lr", "1"], 1, "--min-lr 1.0 must be in"),
        (["--first-last-layers-bf16", "--fp8-recipe", "delayed"], 1, "must leave at least one"),
        (["--hidden-dropout", "1.5"], 1, "must be in [0, 1)"),
        (["--split", "a,b"], 1, "expected numbers"),
        (["--wandb-project", "p", "--wandb-save-dir", "/tmp/w"], 1, "--wandb-exp-name is not"),
        (["--wandb-project", "p", "--wandb-exp-name", "e"], 1, "--wandb-save-dir is not"),
    ],
)  # fmt: skip
def test_invalid_combinations(extra, world_size, expected, capsys):
    assert expected in parse_error(TINY_GPT + extra, capsys, world_size=world_size)


def test_missing_data_names_both_fixes(capsys):
    err = parse_error(["--num-layers", "2"], capsys)
    assert "--data-path PREFIX" in err and "--mock-data" in err


def test_missing_tokenizer_file(capsys, tmp_path):
    argv = ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]  # fmt: skip
    assert f"--vocab-file {tmp_path / 'vocab.json'}: no such file" in parse_error(argv, capsys)


def test_recipe_implies_hybrid_format():
    args = parse_args(TINY_GPT + ["--fp8-recipe", "mxfp8"], world_size=1)
    assert args.fp8_format == "hybrid"
    args = parse_args(TINY_GPT + ["--fp8-recipe", "mxfp8", "--fp8-format", "e4m3"], world_size=1)
    assert args.fp8_format == "e4m3"


def test_wandb_save_dir_defaults_under_save():
    argv = TINY_GPT + ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "/tmp/ck"]
    assert parse_args(argv, world_size=1).wandb_save_dir == "/tmp/ck/wandb"


def test_derived_defaults():
    args = parse_args(TINY_GPT + ["--train-iters", "30"], world_size=2)
    assert args.num_microbatches == 2  # 8 / (2 x 2)
    assert args.lr_decay_iters == 30
    assert args.ckpt_format == "torch"
    fsdp = parse_args(TINY_GPT + ["--use-megatron-fsdp"], world_size=2)
    assert fsdp.ckpt_format == "torch_dist"


def test_cli_exits_2_before_building_a_model():
    """The real entry point: status 2, one-line message, no traceback."""
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *TINY_GPT, "--global-batch-size", "7"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "--global-batch-size 7 is not a multiple of" in proc.stderr
    assert "Traceback" not in proc.stderr and "number of parameters" not in proc.stdout
