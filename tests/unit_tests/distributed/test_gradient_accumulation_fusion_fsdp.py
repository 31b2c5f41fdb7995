"""Gradient accumulation fusion under Megatron-FSDP (FsdpConfig.gradient_accumulation_fusion,
`--no-gradient-accumulation-fusion` turns it off): the engine attaches itself as each FP8
weight's main_grad_sink, the wgrad GEMMs write into its grad slots (one write per FP8 weight and
micro-batch, counted), and training gives the same losses as the unfused path under every
strategy, with micro-batch accumulation, at DP 2 (fp32 toy: both paths store the same fp32
product, so equal means bitwise)."""

from __future__ import annotations

import pytest

from megatron.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.fp8.main_grad import has_main_grad_sink
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_fsdp_config
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.fp8_toy import build_fp8_toy, fp8_config, fp8_weights, train, wrap
from tests.unit_tests.training.common import TINY_GPT

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _losses(rank: int, world_size: int, recipe: str) -> dict:
    counts, losses = {}, {}
    written = MegatronFSDP.main_grad_written

    def counting(engine, param):
        counts[key] = counts.get(key, 0) + 1
        written(engine, param)

    MegatronFSDP.main_grad_written = counting
    try:
        for strategy in STRATEGIES:
            for fuse in (True, False):
                key = (strategy, fuse)
                config = fp8_config(recipe)
                state = wrap(
                    build_fp8_toy(config),
                    strategy=strategy,
                    config=config,
                    gradient_accumulation_fusion=fuse,
                )
                sinks = {has_main_grad_sink(p) for p in fp8_weights(state.model).values()}
                assert sinks == {fuse}
                losses[key] = train(state, range(4), config=config, micro_batches=2)
    finally:
        MegatronFSDP.main_grad_written = written
    return dict(losses=losses, counts=counts)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fused_wgrad_trains_as_unfused_under_every_strategy(recipe: str):
    result = run_distributed(_losses, 2, recipe)[0]
    losses, counts = result["losses"], result["counts"]
    for strategy in STRATEGIES:
        fused, unfused = losses[(strategy, True)], losses[(strategy, False)]
        assert fused == unfused, strategy
        assert fused[-1] < fused[0], strategy
        # 2 layers x 2 FP8 weights, 2 micro-batches, 4 steps.
        assert counts[(strategy, True)] == 2 * 2 * 2 * 4, strategy
        assert (strategy, False) not in counts


def test_flag_reaches_the_engine_config():
    fsdp = ["--use-megatron-fsdp"]
    on = parse_args(TINY_GPT + fsdp, world_size=2)
    off = parse_args(TINY_GPT + fsdp + ["--no-gradient-accumulation-fusion"], world_size=2)
    assert build_fsdp_config(on).gradient_accumulation_fusion is True  # Megatron-LM's default
    assert build_fsdp_config(off).gradient_accumulation_fusion is False
