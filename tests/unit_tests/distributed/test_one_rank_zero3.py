"""ZeRO-3 over a data-parallel group of one rank (a single GPU, issue 37): the rank holds the
whole model, so an all-gather would only copy what it already has. The stored compute values
(FP8 bytes, dense values in the main params' dtype) are the gathered ones and stay between
micro-batches; bf16 compute values are cast from the fp32 main params straight into the
gathered buffer. No collective runs, and the losses are bitwise those of no_shard."""

from __future__ import annotations

import torch

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.fp8_storage import Fp8ComputeStorage
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.storage import DenseComputeStorage
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.fp8_toy import (
    RECIPES,
    build_fp8_toy,
    fp8_config,
    fp8_weights,
    train,
    wrap,
)
from tests.unit_tests.distributed.toy_model import OPT_CONFIG, RunState, build_toy, train_steps


def _dense(strategy: str, dtype: torch.dtype) -> tuple[list[float], dict, list]:
    """3 steps of 2 micro-batches of the toy GPT in `dtype` (fp32 main params)."""
    config = FsdpConfig(data_parallel_sharding_strategy=strategy)
    model = FullyShardedDataParallel(build_toy().to(dtype), fsdp_config=config, device="cpu")
    state = RunState(model=model, optimizer=model.build_optimizer(OPT_CONFIG))
    losses, stats = train_steps(state, range(3), micro_batches=2)
    return losses, stats[-1], [g.storage for g in model.engine.buffer.all_groups()]


def _one_rank(rank: int, world_size: int) -> dict:
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        zero3, stats, storages = _dense("optim_grads_params", dtype)
        no_shard, _, _ = _dense("no_shard", dtype)
        casts = [s.casts_main_shard for s in storages if isinstance(s, DenseComputeStorage)]
        result[str(dtype)] = dict(zero3=zero3, no_shard=no_shard, stats=stats, casts=casts)
    for recipe in RECIPES:
        config = fp8_config(recipe)
        runs = {}
        for strategy in ("optim_grads_params", "no_shard"):
            state = wrap(build_fp8_toy(config), strategy=strategy, config=config)
            runs[strategy] = train(state, range(3), config=config, micro_batches=2)
            runs[f"{strategy} stats"] = state.model.comm_stats()
            if strategy == "optim_grads_params":
                storages = [g.storage for g in state.model.engine.buffer.all_groups()]
                fp8 = [s for s in storages if isinstance(s, Fp8ComputeStorage)]
                # Each weight reads the bytes its storage keeps (the stored shard itself).
                runs["reads stored bytes"] = [
                    qt.rowwise_data.untyped_storage().data_ptr()
                    in {s.shard["rowwise"].untyped_storage().data_ptr() for s in fp8}
                    for qt in fp8_weights(state.model).values()
                ]
        result[recipe] = runs
    return result


def test_zero3_over_one_rank_gathers_nothing_and_matches_no_shard() -> None:
    (result,) = run_distributed(_one_rank, 1)
    for dtype, casts in (("torch.float32", [False]), ("torch.bfloat16", [True])):
        got = result[dtype]
        assert set(got["casts"]) == set(casts), dtype
        assert got["zero3"] == got["no_shard"], dtype  # bitwise: the same values
        assert got["stats"]["all_gather_bytes"] == 0, dtype
    for recipe in RECIPES:
        got = result[recipe]
        assert got["optim_grads_params"] == got["no_shard"], recipe
        stats = got["optim_grads_params stats"]
        assert stats["all_gather_bytes"] == 0, (recipe, stats)
        assert stats.get("fp8_all_gather_bytes", 0) == 0, recipe
        assert got["reads stored bytes"] == [True] * 4, recipe
