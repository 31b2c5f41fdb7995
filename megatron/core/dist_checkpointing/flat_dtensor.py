"""A flattened parameter's contiguous local piece as a DTensor that DCP can reshard.

Megatron-FSDP shards are contiguous slices of each flattened parameter, uneven across ranks
(and empty on some), which DTensor's own `Shard(0)` layout (torch.chunk's even split) cannot
describe. The piece is therefore wrapped in torch's LocalShardsWrapper, which carries its
explicit [offset, offset + numel) range, inside a DTensor over the data-parallel device mesh:
DCP asks the DTensor for its chunks, the DTensor asks the wrapper, so every rank's chunk is
recorded with its true offset and any other split of the same 1-D tensor reads it back (on gloo
and NCCL alike). A rank that holds none of a parameter leaves the key out of its state dict:
DCP merges keys across ranks, and an empty wrapper would describe a 2-D chunk.

PyTorch FSDP2's parameters (and their optimizer state) are DTensors sharded by rows
(`Shard(0)`): a rank's rows are one contiguous slice of the flattened parameter, so
`flat_row_shard` writes them in the same layout, and the checkpoint loads under either engine.

With expert parallelism a routed-expert parameter is a piece of the full [num_experts, ...]
tensor (`ExpertPlacement`), recorded at its global offset, so the checkpoint holds every expert
by its global index and loads at any expert-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def data_parallel_mesh(process_group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D device mesh of `process_group` (no communication: built from the group)."""
    return DeviceMesh.from_group(process_group, device.type)


def flat_dtensor(
    local_piece: torch.Tensor | None, *, offset: int, global_numel: int, mesh: DeviceMesh
) -> DTensor | None:
    """1-D DTensor of `global_numel` elements of which this rank holds `local_piece` at
    `offset`; None when the rank holds none of it (leave the key out).

    `local_piece` is used in place (a view into a buffer), so DCP saves from and loads into
    the buffer directly. No communication.
    """
    if local_piece is None or local_piece.numel() == 0:
        return None
    wrapper = LocalShardsWrapper([local_piece.view(-1)], [(offset,)])
    return DTensor.from_local(
        wrapper, mesh, [Shard(0)], run_check=False, shape=torch.Size([global_numel]), stride=(1,)
    )


def flat_dtensor_runs(
    local_piece: torch.Tensor | None,
    runs: list[tuple[int, int, int]],
    *,
    global_numel: int,
    mesh: DeviceMesh,
) -> DTensor | None:
    """flat_dtensor of a piece whose elements lie at several places of the global tensor:
    `runs` lists (start in the piece, global offset, length), covering the piece in order
    (a tensor-parallel shard's piece, `TensorParallelPlacement.runs`). Each run is a view,
    so DCP saves from and loads into the piece in place. None when the piece is empty."""
    if local_piece is None or local_piece.numel() == 0:
        return None
    flat = local_piece.view(-1)
    shards = [flat[start : start + length] for start, _, length in runs]
    wrapper = LocalShardsWrapper(shards, [(offset,) for _, offset, _ in runs])
    return DTensor.from_local(
        wrapper, mesh, [Shard(0)], run_check=False, shape=torch.Size([global_numel]), stride=(1,)
    )


def flat_row_shard(value: DTensor) -> DTensor | None:
    """A DTensor sharded by rows over a 1-D mesh (an FSDP2 parameter or its Adam moment) as a
    flat_dtensor of its flattened values, viewing the same local storage; None where this
    rank holds no row."""
    if tuple(value.placements) != (Shard(0),):
        raise ValueError(f"expected rows sharded over a 1-D mesh, got {value.placements}")
    _, global_offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    row_numel = value.numel() // value.shape[0] if value.shape[0] else 0
    return flat_dtensor(
        value.to_local().detach(),
        offset=int(global_offset[0]) * row_numel,
        global_numel=value.numel(),
        mesh=value.device_mesh,
    )


def local_piece(value: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's piece of a flat_dtensor (None if it holds none), or a plain tensor; the
    runs of a flat_dtensor_runs concatenated (a copy: compare storage before copying back)."""
    if not isinstance(value, DTensor):
        return value
    wrapper = value.to_local()
    if isinstance(wrapper, LocalShardsWrapper):
        shards = wrapper.local_shards()
        if len(shards) > 1:
            return torch.cat([shard.view(-1) for shard in shards])
        return shards[0] if shards else None
    return wrapper


def piece_runs(value: DTensor) -> list[tuple[int, int, int]]:
    """(start in the local piece, global offset, length) of each run of a flat_dtensor or
    flat_dtensor_runs, as flat_dtensor_runs takes them."""
    wrapper = value.to_local()
    runs, start = [], 0
    for offset, size in zip(wrapper.local_offsets(), wrapper.local_sizes(), strict=True):
        runs.append((start, int(offset[0]), int(size[0])))
        start += int(size[0])
    return runs


@dataclass(frozen=True)
class ExpertPlacement:
    """Where this rank's routed experts lie in a checkpoint's full [num_experts, ...] tensors.

    Expert-parallel rank r of E holds the consecutive experts [r * n, (r + 1) * n) of every
    routed-expert parameter (n = num_experts / E), so its flattened local tensor is the slice
    [r * m, (r + 1) * m) of the flattened full tensor (m = its local numel): a checkpoint
    records the full tensor by global expert index, and any other EP size reads its rows back.
    """

    names: frozenset[str]
    ep_rank: int
    ep_size: int

    @classmethod
    def of_group(cls, names, group: dist.ProcessGroup | None) -> ExpertPlacement | None:
        """The placement of `names` over the expert-parallel `group` (None: no EP)."""
        if group is None:
            return None
        return cls(frozenset(names), dist.get_rank(group), dist.get_world_size(group))

    def place(self, name: str, offset: int, numel: int) -> tuple[int, int]:
        """(offset in the full flat tensor, its numel) of a piece at `offset` of the local
        flat parameter `name` of `numel` elements; unchanged for a parameter not an expert's."""
        if name not in self.names:
            return offset, numel
        return self.ep_rank * numel + offset, self.ep_size * numel

    def global_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if name not in self.names:
            return tuple(shape)
        return (shape[0] * self.ep_size, *shape[1:])
