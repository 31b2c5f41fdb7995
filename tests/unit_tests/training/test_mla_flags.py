"""DeepSeek-V3-style flags: parse-time refusals (exit 2, one line naming flags and fix), the
config they build, and MTP losses in the training log line under Megatron-LM's names."""

from __future__ import annotations

import re

import pytest

from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_transformer_config
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

MLA = [
    "--multi-latent-attention",
    "--kv-lora-rank",
    "32",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "16",
    "--v-head-dim",
    "16",
    "--position-embedding-type",
    "rope",
]


def _refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY_GPT + argv, world_size=1)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    return errors[0]


@pytest.mark.parametrize(
    "argv, named",
    [
        (MLA + ["--kv-lora-rank", "0"], "--kv-lora-rank 0 must be a positive width"),
        (MLA + ["--v-head-dim", "-1"], "--v-head-dim -1 must be a positive width"),
        (MLA + ["--q-lora-rank", "0"], "--q-lora-rank 0 must be positive; omit it"),
        (MLA + ["--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5 must be a positive even"),
        (
            MLA + ["--group-query-attention", "--num-query-groups", "2"],
            "--num-query-groups 2: multi-latent attention has no key/value groups",
        ),
        (MLA + ["--rotary-percent", "0.5"], "drop --rotary-percent 0.5"),
        (MLA + ["--rotary-scaling-factor", "0"], "--rotary-scaling-factor 0.0 must be positive"),
        (
            MLA + ["--fp8-recipe", "tensorwise", "--kv-lora-rank", "24"],
            # every odd width in the one line (two launches were needed to learn both)
            "error: --kv-lora-rank = 24; --kv-lora-rank + --qk-pos-emb-head-dim = 40: not "
            "divisible by 16, which FP8 GEMMs need",
        ),
        (["--mtp-num-layers", "-1"], "--mtp-num-layers -1 must be >= 1"),
        (
            ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-1"],
            "--mtp-loss-scaling-factor -1.0 must be a finite number >= 0",
        ),
    ],
)
def test_bad_latent_ranks_head_dims_and_mtp_exit_2_with_one_line(capsys, argv, named):
    assert named in _refusal(capsys, argv)


def test_flags_build_the_config_with_megatron_lm_defaults():
    args = parse_args(TINY_GPT + MLA + ["--qk-layernorm", "--mtp-num-layers", "1"], world_size=1)
    config = build_transformer_config(args, vocab_size=512)
    assert (config.multi_latent_attention, config.qk_layernorm, config.q_lora_rank) == (
        True,
        True,
        None,
    )
    assert (config.kv_lora_rank, config.qk_head_dim, config.v_head_dim) == (32, 16, 16)
    # Megatron-LM: yarn by default under MLA, scaling 1, mscale 1, mscale_all_dim 0.
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale) == ("yarn", 1.0, 1.0)
    assert (config.mscale_all_dim, config.original_max_position_embeddings) == (0.0, 4096)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (1, 0.1)
    plain = build_transformer_config(parse_args(TINY_GPT, world_size=1), vocab_size=512)
    assert (plain.rope_type, plain.mtp_num_layers, plain.qk_layernorm) == ("rope", None, False)
    yarn = parse_args(TINY_GPT + MLA + ["--yarn-beta-fast", "16"], world_size=1)
    assert build_transformer_config(yarn, vocab_size=512).beta_fast == 16.0


LINE = re.compile(
    r" lm loss: (?P<lm>\S+) \| mtp_1 loss: (?P<mtp1>\S+) \| mtp_2 loss: (?P<mtp2>\S+) \|"
)


def test_mtp_losses_appear_in_the_log_line_after_lm_loss(capsys):
    argv = TINY_GPT + NO_DROPOUT + MLA + ["--qk-layernorm", "--q-lora-rank", "32"]
    argv += ["--mtp-num-layers", "2", "--train-iters", "4", "--log-interval", "2"]
    result = run_pretrain(argv)
    lines = [LINE.search(line) for line in capsys.readouterr().out.splitlines()]
    lines = [match for match in lines if match]
    assert len(lines) == 2
    for match, iterations in zip(lines, ((1, 2), (3, 4)), strict=True):
        lm = sum(result.losses[i] for i in iterations) / 2
        assert float(match["lm"]) == pytest.approx(lm, rel=1e-6)
        # At init, predicting 2 and 3 tokens ahead of random mock tokens: near ln(512).
        for name in ("mtp1", "mtp2"):
            assert 5.0 < float(match[name]) < 7.5
    assert result.losses[4] < result.losses[1]
