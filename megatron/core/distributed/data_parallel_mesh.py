"""The data-parallel device mesh: outer (replicate) x inner (shard), built once, passed down.

Hybrid sharded data parallelism (HSDP, `--num-distributed-optimizer-instances N`) splits the
DP ranks into N replicas of DP/N consecutive ranks each. Under torchrun or Slurm consecutive
ranks share a node, so every per-layer all-gather and reduce-scatter stays on NVLink and only
one gradient reduction per step crosses the network:

    mesh = [[0, 1, 2, 3],      dp_outer (replicate): {0, 4}, {1, 5}, ...  across nodes
            [4, 5, 6, 7]]      dp_shard (shard):     {0..3}, {4..7}       inside a node

N = 1 is plain ZeRO (one row). With tensor parallelism (`--tensor-model-parallel-size` T > 1)
the mesh gains a third, innermost dimension `tp` (Megatron-LM's rank order: T consecutive
ranks split each layer), rank = (outer * S + shard) * T + tp_rank. The DP groups are cut
from the mesh by name, so the engine shards each TP rank's local shards over the ranks of
equal tp_rank and never sees TP:

    TP 2 x HSDP 2 x 2: mesh[outer][shard][tp] = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    tp {0, 1}, ...;  dp_shard {0, 2}, {1, 3}, {4, 6}, ...;  dp_outer {0, 4}, {1, 5}, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_OUTER_DIM = "dp_outer"
"""Replicate dimension: ranks holding the same shard in different replicas."""
DP_SHARD_DIM = "dp_shard"
"""Shard dimension: the consecutive ranks of one replica, over which ZeRO shards."""
TP_DIM = "tp"
"""Tensor-parallel dimension (innermost; only when the tensor-parallel size is above 1)."""


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
        else:  # other mesh dimensions (TP): the DP ranks are a sub-mesh
            full = dp_mesh._flatten().get_group()  # noqa: SLF001 - torch's own flatten helper
        return cls(shard=shard, outer=outer, full=full)


def build_data_parallel_mesh(
    *,
    world_size: int,
    num_distributed_optimizer_instances: int,
    device_type: str,
    tensor_parallel_size: int = 1,
) -> DeviceMesh:
    """The (dp_outer, dp_shard) mesh of `world_size` ranks; row r = ranks [r*S, (r+1)*S).
    With `tensor_parallel_size` T > 1, the (dp_outer, dp_shard, tp) mesh: every entry above
    becomes T consecutive ranks.

    Needs the default process group. Raises ValueError (argument checks catch it earlier with
    the flag's name) when T does not divide the world size or N the data-parallel size.
    """
    instances, tp = num_distributed_optimizer_instances, tensor_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the world size {world_size}")
    dp_size = world_size // tp
    if instances < 1 or dp_size % instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} must divide the data-parallel "
            f"size {dp_size}"
        )
    if tp == 1:
        return init_device_mesh(
            device_type,
            (instances, dp_size // instances),
            mesh_dim_names=(DP_OUTER_DIM, DP_SHARD_DIM),
        )
    return init_device_mesh(
        device_type,
        (instances, dp_size // instances, tp),
        mesh_dim_names=(DP_OUTER_DIM, DP_SHARD_DIM, TP_DIM),
    )
