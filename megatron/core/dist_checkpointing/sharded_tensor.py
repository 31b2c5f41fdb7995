"""A flattened parameter's contiguous local piece as a tensor DCP can reshard.

Megatron-FSDP shards are contiguous slices of each flattened parameter, uneven across ranks
(and empty on some), which DTensor's even chunking cannot express. A ShardedTensor with one
explicit [offset, offset + numel) shard per rank can: DCP records every chunk's offsets and
reads any other split of the same 1-D tensor at load time, on gloo and NCCL alike.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    init_from_local_shards,
)


def _placement(tensor: torch.Tensor, global_rank: int) -> str:
    device = tensor.device
    name = device.type if device.index is None else f"{device.type}:{device.index}"
    return f"rank:{global_rank}/{name}"


def flat_sharded_tensor(
    local_piece: torch.Tensor | None,
    *,
    offset: int,
    global_numel: int,
    process_group: dist.ProcessGroup,
) -> ShardedTensor:
    """1-D tensor of `global_numel` elements of which this rank holds `local_piece` at `offset`.

    Collective over `process_group` (every rank calls it for every tensor, in the same order).
    `local_piece` is used in place (a view into a buffer), so DCP saves from and loads into
    the buffer directly.
    """
    shards = []
    if local_piece is not None and local_piece.numel() > 0:
        flat = local_piece.view(-1)
        global_rank = dist.get_global_rank(process_group, dist.get_rank(process_group))
        metadata = ShardMetadata(
            shard_offsets=[offset],
            shard_sizes=[flat.numel()],
            placement=_placement(flat, global_rank),
        )
        shards.append(Shard(tensor=flat, metadata=metadata))
    with warnings.catch_warnings():
        # ShardedTensor is deprecated in favor of DTensor, which cannot express uneven pieces.
        warnings.simplefilter("ignore", FutureWarning)
        return init_from_local_shards(shards, [global_numel], process_group=process_group)


def local_piece(tensor: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of a flat ShardedTensor (None if it holds none), or a plain tensor."""
    if not isinstance(tensor, ShardedTensor):
        return tensor
    shards = tensor.local_shards()
    return shards[0].tensor if shards else None
