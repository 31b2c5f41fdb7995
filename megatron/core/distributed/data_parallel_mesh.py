"""The data-parallel device mesh: outer (replicate) x inner (shard), built once, passed down.

Hybrid sharded data parallelism (HSDP, `--num-distributed-optimizer-instances N`) splits the
DP ranks into N replicas of DP/N consecutive ranks each. Under torchrun or Slurm consecutive
ranks share a node, so every per-layer all-gather and reduce-scatter stays on NVLink and only
one gradient reduction per step crosses the network:

    mesh = [[0, 1, 2, 3],      dp_outer (replicate): {0, 4}, {1, 5}, ...  across nodes
            [4, 5, 6, 7]]      dp_shard (shard):     {0..3}, {4..7}       inside a node

N = 1 is plain ZeRO (one row). A tensor-parallel dimension will be the innermost mesh
dimension when it exists; the DP groups are always cut from the mesh by name, never from
globals, so adding it does not change the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_OUTER_DIM = "dp_outer"
"""Replicate dimension: ranks holding the same shard in different replicas."""
DP_SHARD_DIM = "dp_shard"
"""Shard dimension: the consecutive ranks of one replica, over which ZeRO shards."""


@dataclass(frozen=True)
class DataParallelGroups:
    """The process groups data parallelism runs on, cut from one mesh."""

    shard: dist.ProcessGroup
    """Inner group: parameter all-gathers, gradient reduce-scatters, FP8 amax agreement."""
    outer: dist.ProcessGroup | None
    """Outer group (replicas of the same shard); None with a single instance."""
    full: dist.ProcessGroup
    """Every DP rank: what a quantity summed over all ranks' disjoint pieces reduces over."""

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else dist.get_world_size(self.outer)

    @property
    def dp_size(self) -> int:
        return self.shard_size * self.outer_size

    @property
    def outer_rank(self) -> int:
        return 0 if self.outer is None else dist.get_rank(self.outer)

    @classmethod
    def single_group(cls, group: dist.ProcessGroup) -> DataParallelGroups:
        """Plain ZeRO over `group`: it is both the shard group and the full DP group."""
        return cls(shard=group, outer=None, full=group)

    @classmethod
    def from_mesh(
        cls, mesh: DeviceMesh, *, shard_dim: str = DP_SHARD_DIM, outer_dim: str | None = None
    ) -> DataParallelGroups:
        """Groups of `mesh`'s `shard_dim` and (for HSDP) `outer_dim` dimensions."""
        shard = mesh.get_group(shard_dim)
        if outer_dim is None or mesh[outer_dim].size() == 1:
            return cls(shard=shard, outer=None, full=shard)
        outer = mesh.get_group(outer_dim)
        dp_mesh = mesh[(outer_dim, shard_dim)]
        if dp_mesh.size() == dist.get_world_size():
            full = dist.group.WORLD
        else:  # other mesh dimensions (TP later): the DP ranks are a sub-mesh
            full = dp_mesh._flatten().get_group()  # noqa: SLF001 - torch's own flatten helper
        return cls(shard=shard, outer=outer, full=full)


def build_data_parallel_mesh(
    *, world_size: int, num_distributed_optimizer_instances: int, device_type: str
) -> DeviceMesh:
    """The (dp_outer, dp_shard) mesh of `world_size` ranks; row r = ranks [r*S, (r+1)*S).

    Needs the default process group. Raises ValueError (argument checks catch it earlier with
    the flag's name) when N does not divide the world size.
    """
    instances = num_distributed_optimizer_instances
    if instances < 1 or world_size % instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} must divide the data-parallel "
            f"size {world_size}"
        )
    return init_device_mesh(
        device_type,
        (instances, world_size // instances),
        mesh_dim_names=(DP_OUTER_DIM, DP_SHARD_DIM),
    )
