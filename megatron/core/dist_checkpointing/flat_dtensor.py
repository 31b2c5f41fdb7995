"""A flattened parameter's contiguous local piece as a DTensor that DCP can reshard.

Megatron-FSDP shards are contiguous slices of each flattened parameter, uneven across ranks
(and empty on some), which DTensor's own `Shard(0)` layout (torch.chunk's even split) cannot
describe. The piece is therefore wrapped in torch's LocalShardsWrapper, which carries its
explicit [offset, offset + numel) range, inside a DTensor over the data-parallel device mesh:
DCP asks the DTensor for its chunks, the DTensor asks the wrapper, so every rank's chunk is
recorded with its true offset and any other split of the same 1-D tensor reads it back (on gloo
and NCCL alike). A rank that holds none of a parameter leaves the key out of its state dict:
DCP merges keys across ranks, and an empty wrapper would describe a 2-D chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper


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


def local_piece(value: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's piece of a flat_dtensor (None if it holds none), or a plain tensor."""
    if not isinstance(value, DTensor):
        return value
    wrapper = value.to_local()
    if isinstance(wrapper, LocalShardsWrapper):
        shards = wrapper.local_shards()
        return shards[0] if shards else None
    return wrapper


def piece_offset(value: DTensor) -> int:
    """The global offset of a flat_dtensor's local piece."""
    return int(value.to_local().local_offsets()[0][0])
