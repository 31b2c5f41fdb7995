"""Issue 40, acceptance 1 (Megatron-FSDP rows) on CPU/gloo: the tiny GPT trains 20 fp32 steps
with tensor parallelism under Megatron-FSDP, each TP rank's shards sharded over its DP groups:
TP 2 x DP 1, TP 2 x DP 2 (ZeRO-3), TP 4 x DP 2 and TP 2 x HSDP 2 x 2, with and without
--sequence-parallel, and the other strategies at TP 2 x DP 2; the single-process losses within
1e-5 (the clip is active: the grad norm summed over TP must be the TP = 1 one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_mesh import (
    DP_OUTER_DIM,
    DP_SHARD_DIM,
    TP_DIM,
    DataParallelGroups,
    build_data_parallel_mesh,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)

STEPS = 20
ARGV = TINY_GPT + NO_DROPOUT + ["--train-iters", str(STEPS)]
_REFERENCE: dict[int, float] = {}


def _reference() -> dict[int, float]:
    if not _REFERENCE:
        _REFERENCE.update(run_pretrain(ARGV).losses)
    return _REFERENCE


def _fsdp(strategy: str, tp: int, *extra: str) -> list[str]:
    return [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        strategy,
        "--tensor-model-parallel-size",
        str(tp),
        *extra,
    ]


SP = "--sequence-parallel"
HSDP = ("--num-distributed-optimizer-instances", "2")
CASES = {
    "tp2xdp1-zero3-sp": (_fsdp("optim_grads_params", 2, SP), 2),
    "tp2xdp2-zero3": (_fsdp("optim_grads_params", 2), 4),
    "tp2xdp2-zero3-sp": (_fsdp("optim_grads_params", 2, SP), 4),
    "tp4xdp2-zero3": (_fsdp("optim_grads_params", 4), 8),
    "tp4xdp2-zero3-sp": (_fsdp("optim_grads_params", 4, SP), 8),
    "tp2xhsdp2x2": (_fsdp("optim_grads_params", 2, *HSDP), 8),
    "tp2xhsdp2x2-sp-outer-optim": (
        _fsdp("optim_grads_params", 2, *HSDP, "--outer-dp-sharding-strategy", "optim", SP),
        8,
    ),
    "tp2xdp2-no_shard-sp": (_fsdp("no_shard", 2, SP), 4),
    "tp2xdp2-optim-sp": (_fsdp("optim", 2, SP), 4),
    "tp2xdp2-optim_grads-sp-meta-init": (
        _fsdp("optim_grads", 2, SP, "--init-model-with-meta-device"),
        4,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_megatron_fsdp_losses_equal_one_process(name) -> None:
    extra, world_size = CASES[name]
    reference = _reference()
    assert sorted(reference) == list(range(1, STEPS + 1))
    per_rank = run_distributed(run_pretrain_on_rank, world_size, ARGV + extra)
    for rank, losses in enumerate(per_rank):
        assert sorted(losses) == sorted(reference), rank
        for iteration, loss in losses.items():
            assert loss == pytest.approx(reference[iteration], abs=1e-5), (rank, iteration)
    assert reference[STEPS] < reference[1] - 0.1  # training moved the loss


def _mesh_groups(rank: int, world_size: int) -> dict[str, list[int]]:
    mesh = build_data_parallel_mesh(
        world_size=world_size,
        num_distributed_optimizer_instances=2,
        device_type="cpu",
        tensor_parallel_size=2,
    )
    groups = DataParallelGroups.from_mesh(mesh, outer_dim=DP_OUTER_DIM)
    members = {
        "tp": mesh.get_group(TP_DIM),
        "shard": mesh.get_group(DP_SHARD_DIM),
        "outer": groups.outer,
        "full": groups.full,
    }
    found = {}
    for key, group in members.items():
        ranks = torch.zeros(world_size, dtype=torch.int64)
        ranks[rank] = 1
        dist.all_reduce(ranks, group=group)
        found[key] = ranks.nonzero().flatten().tolist()
    assert groups.shard_size == 2 and groups.outer_size == 2 and groups.dp_size == 4
    return found


def test_tp_x_hsdp_mesh_is_megatron_lm_rank_order() -> None:
    """TP innermost (consecutive ranks), then the shard dimension, then the replicas."""
    per_rank = run_distributed(_mesh_groups, 8)
    assert per_rank[0] == {"tp": [0, 1], "shard": [0, 2], "outer": [0, 4], "full": [0, 2, 4, 6]}
    assert per_rank[7] == {"tp": [6, 7], "shard": [5, 7], "outer": [3, 7], "full": [1, 3, 5, 7]}
    assert per_rank[3] == {"tp": [2, 3], "shard": [1, 3], "outer": [3, 7], "full": [1, 3, 5, 7]}
