"""Expert-parallel process groups, built once from --expert-model-parallel-size, passed down.

Expert parallelism lives inside the data-parallel ranks, in Megatron-LM's rank order (tensor,
context and pipeline sizes 1): the expert-parallel (EP) groups are blocks of E consecutive
ranks, and the expert-data-parallel (EDP) groups join the ranks at the same place of every
block, world / E ranks each:

    world 4, E 2:   EP {0, 1}, {2, 3}      EDP {0, 2}, {1, 3}

Each rank of an EP group holds num_experts / E of the routed experts and exchanges tokens with
the others by all-to-all; the replicas of one expert are the EDP group, over which its grads
are reduced (dense parameters: over every DP rank).

Under HSDP (N replicas of S = world / N consecutive ranks, E dividing S) the EP blocks lie
inside one replica, and the EDP group splits as Megatron-LM's intra/inter-partial expert-data-
parallel groups: Megatron-FSDP shards an expert over the EDP ranks of its own replica (S / E
ranks) and replicates that shard across the replicas over the dense outer group (rank r and
r + S hold the same experts at the same shard position):

    world 4, N 2, E 2:  replicas {0, 1}, {2, 3}   EP {0, 1}, {2, 3}
                        EDP in a replica {0}, {1}, {2}, {3}   outer {0, 2}, {1, 3}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def expert_parallel_rank_lists(
    world_size: int, ep_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, EDP groups) as rank lists, Megatron-LM's order."""
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} must divide the data-parallel size "
            f"({world_size} ranks)"
        )
    ep_groups = [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]
    edp_groups = [list(range(offset, world_size, ep_size)) for offset in range(ep_size)]
    return ep_groups, edp_groups


def replica_expert_dp_rank_lists(world_size: int, ep_size: int, instances: int) -> list[list[int]]:
    """The EDP groups cut at the HSDP replica borders (Megatron-LM's intra-partial expert-data-
    parallel groups): the ranks of one replica at the same place of every EP block."""
    replica = world_size // instances if instances >= 1 and world_size % instances == 0 else 0
    if not replica or replica % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} must divide the ranks of one HSDP replica "
            f"({world_size} ranks / --num-distributed-optimizer-instances {instances})"
        )
    return [
        list(range(start + offset, start + replica, ep_size))
        for start in range(0, world_size, replica)
        for offset in range(ep_size)
    ]


@dataclass(frozen=True)
class ExpertParallelGroups:
    """This rank's EP and EDP groups. With E = 1 there is no EP group (None) and the EDP group
    is the data-parallel group (None for a single process). expert_dp_shard: the EDP ranks of
    this rank's HSDP replica, which Megatron-FSDP shards experts over (expert_dp without HSDP)."""

    ep: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None
    ep_size: int = 1
    expert_dp_shard: dist.ProcessGroup | None = None

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep is None else dist.get_rank(self.ep)


def _own_group(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup:
    """One new group per list (collective over the world); the one holding `rank`."""
    own = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            own = group
    return own


def build_expert_parallel_groups(
    *, ep_size: int, dp_group: dist.ProcessGroup | None, instances: int = 1
) -> ExpertParallelGroups:
    """Every rank calls this with the same ep_size and HSDP `instances` (new_group is
    collective over the world)."""
    if ep_size == 1:
        return ExpertParallelGroups(ep=None, expert_dp=dp_group, expert_dp_shard=dp_group)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    ep_lists, edp_lists = expert_parallel_rank_lists(world_size, ep_size)
    ep_group = _own_group(ep_lists, rank)
    edp_group = _own_group(edp_lists, rank)
    edp_shard = edp_group
    if instances > 1:
        edp_shard = _own_group(replica_expert_dp_rank_lists(world_size, ep_size, instances), rank)
    return ExpertParallelGroups(
        ep=ep_group, expert_dp=edp_group, ep_size=ep_size, expert_dp_shard=edp_shard
    )


@torch.no_grad()
def reduce_expert_grads(
    params: list[torch.Tensor], groups: ExpertParallelGroups, *, dp_size: int
) -> None:
    """Expert grads of one step, summed over their replicas (the EDP group) and divided by the
    data-parallel size: each rank's loss is its own micro-batch's mean and the step's loss the
    mean over the DP ranks, and the tokens of all EP ranks already reached an expert's grad
    through the all-to-all's backward. For replicated (DDP) expert parameters."""
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    if groups.expert_dp is not None:
        dist.all_reduce(flat, group=groups.expert_dp)
    flat /= dp_size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
