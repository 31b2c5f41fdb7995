"""Where a tensor-parallel rank's shard lies in a checkpoint's full (TP = 1) flat tensor.

A parameter split over TP is saved as the full logical tensor, flattened, as at TP = 1, so a
checkpoint written at one TP x DP layout loads at any other. Its split (`TensorSplit`) names
the dimension and the fused blocks along it: a column-parallel weight is split on dim 0 block
by block (QKV's [q | k | v], SwiGLU fc1's [gate | up]: rank r holds piece r of every block,
concatenated, so the saved fc1 is TP = 1's [gate; up]), a row-parallel weight on dim 1, a
vocab-parallel table by rows. A contiguous piece of the flattened local shard (what
Megatron-FSDP holds) is then a list of runs, each contiguous in the full flat tensor: one per
block and row-group on dim 0, one per row on dim 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorSplit:
    """A parameter split over TP: `dim` (0 or 1), the widths of its fused `blocks` along it
    (summing to the full size), and the full shape."""

    dim: int
    blocks: tuple[int, ...]
    full_shape: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """`length` elements at `local` in the piece, at `full` in the full flat tensor."""

    local: int
    full: int
    length: int


@dataclass(frozen=True)
class TensorParallelPlacement:
    """The splits of the parameters that differ across the TP ranks, and this rank's place."""

    splits: Mapping[str, TensorSplit] = field(hash=False)
    tp_rank: int
    tp_size: int

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.splits)

    def global_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        split = self.splits.get(name)
        return tuple(shape) if split is None else split.full_shape

    def global_numel(self, name: str) -> int:
        return math.prod(self.splits[name].full_shape)

    def _segments(self, split: TensorSplit) -> list[tuple[int, int, int]]:
        """(local start, length, full start) along the split dimension, block by block."""
        segments, local, full = [], 0, 0
        for width in split.blocks:
            piece = width // self.tp_size
            segments.append((local, piece, full + self.tp_rank * piece))
            local, full = local + piece, full + width
        return segments

    def runs(self, name: str, start: int, numel: int) -> list[Run]:
        """The runs of the piece [start, start + numel) of the flattened local shard of
        `name`, in order (they cover the piece)."""
        split = self.splits[name]
        dim, shape = split.dim, split.full_shape
        inner = math.prod(shape[dim + 1 :])
        full_dim = shape[dim]
        local_dim = full_dim // self.tp_size
        segments = self._segments(split)
        end = start + numel
        runs = []
        stride = local_dim * inner  # one index of the dimensions before `dim`
        for outer in range(start // stride, (end - 1) // stride + 1 if numel else 0):
            for local_start, length, full_start in segments:
                lo = outer * stride + local_start * inner
                hi = lo + length * inner
                lo_cut, hi_cut = max(lo, start), min(hi, end)
                if lo_cut >= hi_cut:
                    continue
                full = (outer * full_dim + full_start) * inner + (lo_cut - lo)
                runs.append(Run(lo_cut - start, full, hi_cut - lo_cut))
        return runs
