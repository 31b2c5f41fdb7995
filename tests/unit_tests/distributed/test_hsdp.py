"""HSDP (outer replicate x inner shard) trains like one process, and moves the bytes it should.

Acceptance of issue 22 on CPU/gloo: 4 ranks as 2 x 2 (and 4 x 1), 8 ranks as 2 x 4; outer
no_shard and optim. fp32 losses equal one process on the same global batch; each byte counter
is checked against its formula and against plain ZeRO-3 at the inner size.
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from megatron.core.distributed.data_parallel_mesh import (
    DP_OUTER_DIM,
    build_data_parallel_mesh,
)
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.traffic import Unit, counter_bytes
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.toy_model import (
    GLOBAL_BATCH,
    OPT_CONFIG,
    RunState,
    build_toy,
    reference_losses,
    train_steps,
)

STEPS = 20


def wrap_hsdp(module, *, instances: int, config: FsdpConfig, **kwargs) -> RunState:
    """`module` under Megatron-FSDP on a (instances x world/instances) mesh of all ranks."""
    mesh = build_data_parallel_mesh(
        world_size=dist.get_world_size(),
        num_distributed_optimizer_instances=instances,
        device_type="cpu",
    )
    model = FullyShardedDataParallel(
        module,
        fsdp_config=config,
        device="cpu",
        device_mesh=mesh,
        dp_outer_dim=DP_OUTER_DIM,
        **kwargs,
    )
    return RunState(model=model, optimizer=model.build_optimizer(OPT_CONFIG))


def _fp32_run(rank: int, world_size: int, instances: int, cases: list) -> dict:
    """Losses of every case (hidden 16, 20 steps) and the byte counters of the last of 2 steps
    of the hidden-6 toy (whose unit sizes test_fsdp_memory_and_comm spells out)."""
    groups = wrap_hsdp(build_toy(), instances=instances, config=FsdpConfig()).model.dp_groups
    result = {
        "shard_ranks": dist.get_process_group_ranks(groups.shard),
        "outer_ranks": dist.get_process_group_ranks(groups.outer) if groups.outer else None,
    }
    # 2 micro-batches (the first under no_sync) while a rank's share of the batch allows.
    micro = 2 if 2 * world_size <= GLOBAL_BATCH else 1
    for strategy, outer, overlap in cases:
        config = FsdpConfig(
            data_parallel_sharding_strategy=strategy,
            outer_dp_sharding_strategy=outer,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        state = wrap_hsdp(build_toy(), instances=instances, config=config)
        result[(strategy, outer, overlap)], _ = train_steps(
            state, range(STEPS), micro_batches=micro
        )
        if strategy == ZERO3 and not overlap:
            state = wrap_hsdp(build_toy(hidden=6), instances=instances, config=config)
            _, stats = train_steps(state, range(2), micro_batches=micro)
            result[("bytes", outer)] = stats[-1]
    return result


ZERO3 = "optim_grads_params"
FP32_CASES = {
    # 2 x 2: both outer strategies, overlap on and off, and the other inner strategies.
    (4, 2): [
        (ZERO3, "no_shard", False),
        (ZERO3, "optim", False),
        (ZERO3, "no_shard", True),
        (ZERO3, "optim", True),
        ("optim", "optim", False),
        ("optim_grads", "no_shard", True),
    ],
    (4, 4): [(ZERO3, "no_shard", False), (ZERO3, "optim", False)],  # 4 x 1: pure replicas
    (8, 2): [(ZERO3, "no_shard", False), (ZERO3, "optim", False)],  # 2 x 4
}


@functools.cache
def fp32_results(world_size: int, instances: int) -> list[dict]:
    """One multi-rank run per mesh shape, shared by the loss and the byte-counter tests."""
    return run_distributed(_fp32_run, world_size, instances, FP32_CASES[(world_size, instances)])


@pytest.mark.parametrize("world_size, instances", list(FP32_CASES))
def test_fp32_losses_equal_single_process(world_size: int, instances: int) -> None:
    expected = reference_losses(STEPS)
    assert expected[-1] < expected[0] - 0.1  # it learns
    results = fp32_results(world_size, instances)
    # Consecutive ranks form a replica (one node); the outer group links equal shard ranks.
    inner = world_size // instances
    for rank, result in enumerate(results):
        first = rank // inner * inner
        assert result["shard_ranks"] == list(range(first, first + inner))
        assert result["outer_ranks"] == list(range(rank % inner, world_size, inner)), rank
    for case in FP32_CASES[(world_size, instances)]:
        losses = results[0][case]
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, expected)):
            assert got == pytest.approx(want, rel=1e-5, abs=0), (case, step)
        for rank_result in results[1:]:
            assert rank_result[case] == losses  # every rank logs the same global loss


# Hidden-6 toy, fp32: root unit (embedding + final norm) 204 elements, each of 2 layers 174.
ROOT, LAYERS = Unit(204, 4), [Unit(174, 4), Unit(174, 4)]


@pytest.mark.parametrize("world_size, instances", [(4, 2), (8, 2), (4, 4)])
def test_inner_and_outer_byte_counters(world_size: int, instances: int) -> None:
    """The measured counters equal traffic.counter_bytes, the formulas docs/SCALING.md is built
    from: inner traffic is plain ZeRO-3's at DP/N ranks (none over a shard group of one rank:
    4 x 1); outer traffic is one shard's grads per step (outer no_shard: all-reduced), or that
    shard, padded to N parts, reduce-scattered plus the fp32 main shard all-gathered (outer
    optim)."""
    inner = world_size // instances
    micro = 2 if 2 * world_size <= GLOBAL_BATCH else 1
    for outer in ("no_shard", "optim"):
        expected = counter_bytes(
            ROOT,
            LAYERS,
            shard_size=inner,
            outer_size=instances,
            outer_strategy=outer,
            micro_batches=micro,
        )
        plain = counter_bytes(ROOT, LAYERS, shard_size=inner, micro_batches=micro)
        assert {key: expected[key] for key in plain} == plain  # inner = ZeRO-3 at DP/N
        for result in fp32_results(world_size, instances):
            assert result[("bytes", outer)] == expected, outer
    if instances == world_size:
        assert fp32_results(4, 4)[0][("bytes", "no_shard")]["all_gather_bytes"] == 0
        assert fp32_results(4, 4)[0][("bytes", "no_shard")]["reduce_scatter_bytes"] == 0
    if (world_size, instances) == (4, 2):
        # Spelled out for 2 x 2 (2 micro-batches): ZeRO-3 at 2 ranks as test_fsdp_memory_and_comm
        # asserts it; shards of 102 + 87 + 87 elements, which outer optim pads to 102 + 88 + 88.
        got = fp32_results(4, 2)[0]
        assert got[("bytes", "no_shard")] == {
            "all_gather_bytes": 2 * (204 + 4 * 174) * 4,
            "reduce_scatter_bytes": 2 * (204 + 2 * 174) * 4,
            "all_reduce_bytes": 0,
            "outer_all_reduce_bytes": 276 * 4,
            "outer_reduce_scatter_bytes": 0,
            "outer_all_gather_bytes": 0,
        }
        assert got[("bytes", "optim")]["outer_reduce_scatter_bytes"] == 278 * 4
        assert got[("bytes", "optim")]["outer_all_gather_bytes"] == 278 * 4
