"""muP flags: Megatron-LM's names and defaults, bad values exit 2 in one line, configs."""

from __future__ import annotations

import pytest

from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import (
    build_optimizer_config,
    build_transformer_config,
    resolved_flags,
)
from tests.unit_tests.training.common import TINY_GPT


def parse(argv):
    return parse_args(TINY_GPT + argv, world_size=1)


def test_mup_flags_reach_the_model_and_optimizer_configs():
    args = parse(
        ["--use-mup", "--mup-base-hidden-size", "16", "--mup-base-head-dim", "8"]
        + ["--mup-attn-scale-power", "0.5", "--mup-embedding-mult", "3", "--mup-output-mult", "2"]
    )
    config = build_transformer_config(args, vocab_size=512)
    assert (config.use_mup, config.mup_base_hidden_size, config.mup_base_head_dim) == (True, 16, 8)
    assert (config.mup_attn_scale_power, config.mup_embedding_mult) == (0.5, 3.0)
    assert config.mup_output_mult == 2.0
    assert build_optimizer_config(args).mup_width_mult == 64 / 16


def test_defaults_are_the_standard_parametrization():
    args = parse([])
    assert build_transformer_config(args, vocab_size=512).use_mup is False
    assert build_optimizer_config(args).mup_width_mult == 1.0
    # --use-mup alone: the base is the model itself (width mult 1), as in Megatron-LM.
    args = parse(["--use-mup"])
    assert build_transformer_config(args, vocab_size=512).mup_base_hidden_size == 64
    assert build_optimizer_config(args).mup_width_mult == 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mup-base-hidden-size", "0"], "--mup-base-hidden-size 0 must be positive."),
        (["--mup-base-hidden-size", "-64"], "--mup-base-hidden-size -64 must be positive."),
        (["--mup-base-head-dim", "0"], "--mup-base-head-dim 0 must be positive."),
        (["--mup-output-mult", "0"], "--mup-output-mult 0.0 must be positive."),
        (["--mup-embedding-mult", "-1"], "--mup-embedding-mult -1.0 must be positive."),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--use-mup", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("error:") == 1 and message in err


def test_mup_companions_without_use_mup_are_noted_not_used():
    args = parse(["--mup-base-hidden-size", "32", "--mup-width-mult", "2"])
    assert build_optimizer_config(args).mup_width_mult == 1.0
    notes = resolved_flags(args, world_size=1).megatron_lm_notes
    assert "--mup-base-hidden-size: no effect without --use-mup (as in Megatron-LM)." in notes
    assert sum(note.startswith("--mup-width-mult 2: no effect here") for note in notes) == 1
