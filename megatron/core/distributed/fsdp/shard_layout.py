"""Where each parameter lives inside a unit's flat buffer, and which slice each rank owns.

A unit's parameters are laid end to end in one flat index space (registration order). Each
parameter may start at an aligned offset (the storage adapter decides: 1 for bf16/fp32; a
quantization block for FP8 so that blocks never straddle a parameter boundary), and the total
is padded so that it divides evenly into `world_size` equal shards whose size is a multiple of
`shard_alignment` (FP8 later: shard edges on block edges). Rank r owns the contiguous slice
[r * shard_numel, (r + 1) * shard_numel). Padding elements are zero and belong to no parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    name: str
    """Qualified name in the wrapped module (the first name, for tied parameters)."""
    shape: torch.Size
    offset: int
    """First element of the parameter in the unit's flat index space."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that falls inside this rank's shard."""

    slot: ParamSlot
    param_start: int
    """First element of the piece within the flattened parameter."""
    shard_start: int
    """First element of the piece within this rank's shard."""
    numel: int


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class UnitLayout:
    slots: tuple[ParamSlot, ...]
    padded_numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int | None = None) -> list[LocalPiece]:
        """Non-empty intersections of every parameter with `rank`'s shard (default: own)."""
        shard_lo, shard_hi = self.shard_range(self.rank if rank is None else rank)
        pieces: list[LocalPiece] = []
        for slot in self.slots:
            lo, hi = max(slot.offset, shard_lo), min(slot.end, shard_hi)
            if hi > lo:
                pieces.append(
                    LocalPiece(
                        slot=slot,
                        param_start=lo - slot.offset,
                        shard_start=lo - shard_lo,
                        numel=hi - lo,
                    )
                )
        return pieces


def build_unit_layout(
    named_shapes: Sequence[tuple[str, torch.Size]],
    *,
    world_size: int,
    rank: int,
    param_alignment: Callable[[str, torch.Size], int] = lambda name, shape: 1,
    shard_alignment: int = 1,
) -> UnitLayout:
    """Lay parameters out end to end; pad the total to world_size * (multiple of shard_alignment).

    `param_alignment(name, shape)` is the hook for FP8 block layouts: the element multiple at
    which that parameter must start. Dense storage uses 1 (no padding between parameters).
    """
    slots = []
    cursor = 0
    for name, shape in named_shapes:
        cursor = _round_up(cursor, max(1, param_alignment(name, shape)))
        slots.append(ParamSlot(name=name, shape=torch.Size(shape), offset=cursor))
        cursor += torch.Size(shape).numel()
    shard_numel = _round_up(max(1, -(-cursor // world_size)), max(1, shard_alignment))
    return UnitLayout(
        slots=tuple(slots), padded_numel=shard_numel * world_size, world_size=world_size, rank=rank
    )


def outer_chunk_numel(shard_numel: int, *, outer_size: int) -> int:
    """Elements of each replica's part of a shard under outer `optim` (the last may be short)."""
    return -(-shard_numel // outer_size)


def outer_shard_range(shard_numel: int, *, outer_size: int, outer_rank: int) -> tuple[int, int]:
    """The [lo, hi) part of a shard whose optimizer state replica `outer_rank` owns.

    Cut in equal chunks (padding only in the collectives' temporaries), so the inner layout,
    and with it the FP8 block alignment, is the same as without an outer split.
    """
    chunk = outer_chunk_numel(shard_numel, outer_size=outer_size)
    return min(outer_rank * chunk, shard_numel), min((outer_rank + 1) * chunk, shard_numel)


def clip_pieces(pieces: list[LocalPiece], lo: int, hi: int) -> list[LocalPiece]:
    """The parts of `pieces` (offsets within a shard) that fall inside [lo, hi) of it."""
    clipped = []
    for piece in pieces:
        start = max(lo, piece.shard_start)
        end = min(hi, piece.shard_start + piece.numel)
        if end > start:
            clipped.append(
                LocalPiece(
                    slot=piece.slot,
                    param_start=piece.param_start + start - piece.shard_start,
                    shard_start=start,
                    numel=end - start,
                )
            )
    return clipped
