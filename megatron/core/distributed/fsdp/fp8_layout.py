"""Where FP8 quantization blocks fall in a unit's flat buffer, and how shards are cut for them.

A weight of shape [..., K] is viewed as [M, K]. Each direction it stores (rowwise; mxfp8 also
columnwise) has a grid of scale cells (docs/FP8_NUMERICS.md): one cell for per-tensor recipes,
128x128 blocks for blockwise weights, 1x32 (rowwise) and 32x1 (columnwise) blocks for mxfp8.
Every element belongs to exactly one cell per direction; the FP8 face
(`megatron.core.fp8.engine_interface`) finds the partial amax of every cell a rank's flat piece
of the weight touches.

Choice of layout, per recipe (docs/ARCHITECTURE.md, "Shard layout"):
- delayed / tensorwise: one scale per weight, so nothing can be aligned; the per-weight amaxes
  of all weights of a step go into one packed all-reduce MAX. Scales are replicated.
- blockwise (128x128): a 128-row band of a 4096-wide weight is 512K elements, so aligning shard
  edges to bands often costs more than 1%; instead the whole amax grid (1/16384 of the weight's
  elements) joins the same packed all-reduce, which makes straddling blocks exact and leaves
  every rank with every scale (replicated, nothing to gather besides the bytes).
- mxfp8 (1x32 and 32x1): its grids are 1/32 of the elements per direction, too big to
  all-reduce every step, so shard edges are placed on 32-row band edges when that pads the
  unit by under 1% (`mxfp8_aligned_layout`). Then no block straddles a shard, each rank
  quantizes its blocks alone, and its E8M0 scales form a contiguous 1/32-size shard that is
  all-gathered alongside its bytes. When no such cut exists (or a dim is not a multiple of
  32) the unit falls back to the blockwise scheme: full amax grids reduced, scales replicated.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from megatron.core.distributed.fsdp.shard_layout import ParamSlot, UnitLayout, build_unit_layout
from megatron.core.fp8.engine_interface import (
    MXFP8_BLOCK,
    RecipeSpec,
    weight_rows_cols,
    weight_scale_grid,
)

MAX_ALIGNMENT_PADDING = 0.01
"""Largest padding (fraction of the unit) accepted to put shard edges on block edges."""


def grid_numel(shape: torch.Size, spec: RecipeSpec, *, columnwise: bool) -> int:
    """Scale cells of a weight of `shape` in one direction."""
    return torch.Size(weight_scale_grid(shape, spec, columnwise=columnwise)).numel()


def _mxfp8_alignable(shapes: Sequence[torch.Size]) -> bool:
    return all(
        rows % MXFP8_BLOCK == 0 and cols % MXFP8_BLOCK == 0
        # A stacked expert weight's bands must not straddle experts: its matrices' rows.
        for rows, cols in (weight_rows_cols(shape[-2:]) for shape in shapes)
    )


def _edge_on_band(edge: int, slots: Sequence[ParamSlot], starts: list[int]) -> bool:
    """Whether a shard edge at flat element `edge` cuts no 32-row band of any weight."""
    index = bisect.bisect_right(starts, edge) - 1
    if index < 0:
        return True
    slot = slots[index]
    if edge >= slot.end:
        return True  # in a gap or in the final padding
    band = MXFP8_BLOCK * weight_rows_cols(slot.shape)[1]
    return (edge - slot.offset) % band == 0


def _band_edges_between(slots: Sequence[ParamSlot], low: int, high: int) -> list[int]:
    """Every band edge (and slot end) of every weight within [low, high], ascending."""
    edges = set()
    for slot in slots:
        if slot.end < low or slot.offset > high:
            continue
        band = MXFP8_BLOCK * weight_rows_cols(slot.shape)[1]
        first = max(0, -(-(low - slot.offset) // band))
        edge = slot.offset + first * band
        while edge <= min(high, slot.end):
            edges.add(edge)
            edge += band
    return sorted(edges)


def mxfp8_aligned_layout(
    named_shapes: Sequence[tuple[str, torch.Size]], *, world_size: int, rank: int
) -> UnitLayout | None:
    """A layout whose shard edges all fall on 32-row band edges, padding < 1%; else None."""
    if not _mxfp8_alignable([shape for _, shape in named_shapes]):
        return None
    base = build_unit_layout(
        named_shapes, world_size=1, rank=0, param_alignment=lambda name, shape: MXFP8_BLOCK
    )
    slots = base.slots
    used = slots[-1].end if slots else 0
    if world_size == 1 or used == 0:
        return UnitLayout(slots=slots, padded_numel=max(used, MXFP8_BLOCK), world_size=1, rank=0)
    starts = [slot.offset for slot in slots]
    lowest = -(-used // world_size)
    highest = int(used * (1 + MAX_ALIGNMENT_PADDING)) // world_size
    for shard in _band_edges_between(slots, lowest, highest):
        edges = [r * shard for r in range(1, world_size)]
        if all(_edge_on_band(edge, slots, starts) for edge in edges):
            return UnitLayout(
                slots=slots, padded_numel=shard * world_size, world_size=world_size, rank=rank
            )
    return None


def plan_fp8_layout(
    named_shapes: Sequence[tuple[str, torch.Size]],
    spec: RecipeSpec,
    *,
    world_size: int,
    rank: int,
) -> tuple[UnitLayout, bool]:
    """(layout, scales_sharded). scales_sharded: shard edges on block edges (mxfp8 only)."""
    # 1-D weight blocks (mxfp8) have grids too big to all-reduce: try band-aligned edges.
    if spec.columnwise_copy("weight"):
        aligned = mxfp8_aligned_layout(named_shapes, world_size=world_size, rank=rank)
        if aligned is not None:
            return aligned, True
    layout = build_unit_layout(named_shapes, world_size=world_size, rank=rank)
    return layout, False
