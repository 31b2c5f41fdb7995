"""Gradient accumulation fusion under Megatron-FSDP (FsdpConfig.gradient_accumulation_fusion,
`--no-gradient-accumulation-fusion` turns it off): the engine attaches itself as each FP8
weight's main_grad_sink, the wgrad GEMMs write into its grad slots (one write per FP8 weight and
micro-batch, counted), and training gives the same losses as the unfused path under every
strategy, with micro-batch accumulation, at DP 2 (fp32 toy: both paths store the same fp32
product, so equal means bitwise). The routed experts' stacked FP8 weights too (the grouped
function, tensorwise and blockwise): a tiny MoE GPT at EP 2 on 2 ranks, one write per expert
weight and micro-batch, the same losses as `--no-gradient-accumulation-fusion`."""

from __future__ import annotations

import pytest

from megatron.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.fp8.main_grad import has_main_grad_sink
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_fsdp_config
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.fp8_toy import build_fp8_toy, fp8_config, fp8_weights, train, wrap
from tests.unit_tests.training.common import TINY_GPT, run_pretrain
from tests.unit_tests.training.test_moe_training import TINY_MOE, ZERO3

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


def _moe_runs(rank: int, world_size: int, recipe: str, extra: list[str]) -> dict:
    counts: dict = {}
    written = MegatronFSDP.main_grad_written

    def counting(engine, param):
        key = (fuse, "experts" if param.dim() == 3 else "dense")
        counts[key] = counts.get(key, 0) + 1
        written(engine, param)

    argv = [*TINY_MOE, *ZERO3, "--train-iters", "4", "--expert-model-parallel-size", "2"]
    argv += ["--fp8-recipe", recipe, "--fp8-format", "hybrid", "--fp8-param-gather", *extra]
    losses = {}
    MegatronFSDP.main_grad_written = counting
    try:
        for fuse in (True, False):
            off = [] if fuse else ["--no-gradient-accumulation-fusion"]
            losses[fuse] = run_pretrain(argv + off).losses
    finally:
        MegatronFSDP.main_grad_written = written
    return dict(losses=losses, counts=counts)


BF16_GRADS = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]


@pytest.mark.parametrize("grads", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fused_expert_wgrad_trains_as_unfused_at_ep2(recipe: str, grads: str):
    """bf16: --main-grads-dtype bf16 (each expert's two source segments summed in fp32 and
    rounded into the bf16 buffer once, as the engine rounds an unfused fp32 grad)."""
    extra = BF16_GRADS if grads == "bf16" else []
    for result in run_distributed(_moe_runs, 2, recipe, extra):
        losses, counts = result["losses"], result["counts"]
        assert losses[True] == losses[False] and sorted(losses[True]) == [1, 2, 3, 4]
        # One MoE layer (fc1 and fc2 stacked), 2 micro-batches a step (8 / (2 ranks x 2)), 4 steps.
        assert counts[(True, "experts")] == 2 * 2 * 4
        assert counts[(True, "dense")] > 0
        assert all(fuse for fuse, _ in counts)  # no writes without fusion
