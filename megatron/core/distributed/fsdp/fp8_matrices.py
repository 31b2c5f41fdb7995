"""The matrices of an FP8 buffer group: each is quantized on its own scales.

A Linear weight [out, in] is one matrix. The routed experts' stacked weight [E, out, in]
(`Fp8StackedLinear`, one Linear per expert) is E matrices: expert e's [out, in] is quantized
as one Linear weight (docs/FP8_NUMERICS.md, "Experts"): its own per-tensor scale or delayed
state, its own 128x128 blocks or mxfp8 cells, none straddling two experts. So its bytes and
scales do not depend on how many experts a rank holds (the expert-parallel size), and the
expert GEMMs read them as they are. A flat piece of a stacked weight (a shard may hold several
experts, or part of one) is cut at expert edges before its cells are measured or written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.distributed.fsdp.shard_layout import ParamSlot


class Matrix(NamedTuple):
    """One quantized matrix: expert `expert` of slot `slot_index` (None: a 2-D weight)."""

    slot_index: int
    expert: int | None
    shape: torch.Size


class MatrixPiece(NamedTuple):
    """The part of a flat layout piece inside one matrix."""

    expert: int | None
    shard_start: int
    matrix_start: int
    """Offset of the piece's first element inside its matrix (row-major)."""
    numel: int


def is_stacked(shape: torch.Size) -> bool:
    """A stacked expert weight [E, out, in]; Linear weights are 2-D."""
    return len(shape) == 3


def slot_matrices(slots: list[ParamSlot]) -> list[Matrix]:
    """Every matrix of the slots, in slot order, experts in order."""
    matrices = []
    for index, slot in enumerate(slots):
        if is_stacked(slot.shape):
            experts, *matrix = slot.shape
            matrices += [Matrix(index, e, torch.Size(matrix)) for e in range(experts)]
        else:
            matrices.append(Matrix(index, None, slot.shape))
    return matrices


def matrix_pieces(slot: ParamSlot, param_start: int, shard_start: int, numel: int):
    """A flat piece of `slot` ([param_start, param_start + numel) of the parameter, at
    `shard_start` in the shard) cut at expert edges."""
    if not is_stacked(slot.shape):
        return [MatrixPiece(None, shard_start, param_start, numel)]
    size = slot.shape[1:].numel()
    pieces = []
    start, end = param_start, param_start + numel
    while start < end:
        expert = start // size
        stop = min(end, (expert + 1) * size)
        at = shard_start + start - param_start
        pieces.append(MatrixPiece(expert, at, start - expert * size, stop - start))
        start = stop
    return pieces


def matrix_shape(shape: torch.Size) -> torch.Size:
    """The shape each matrix of a weight has: [out, in]."""
    return torch.Size(shape[-2:])


def stacked_grid(shape: torch.Size, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The scale grid of a weight given its matrices' grid: one per expert when stacked."""
    return (shape[0], *grid) if is_stacked(shape) else tuple(grid)


class Run(NamedTuple):
    """Matrices written in one pass of the piece kernels: a 2-D weight; one expert of a
    stacked weight; or all of a stacked weight's experts as its [E * N, K] rows, when a cell of
    `cell_rows` rows gives each expert its own cells (`stacked_cell_rows`; expert None). The
    experts' cells are then the stacked grid's, in order: one pass instead of E."""

    slot_index: int
    expert: int | None
    first: int
    """Index of its first matrix (`slot_matrices`)."""
    count: int
    shape: torch.Size
    """The weight the kernels see: the matrix's, or the stacked weight's."""
    cell_rows: int | None


def slot_runs(slots: list[ParamSlot], cell_rows_of) -> list[Run]:
    """The runs of the slots' matrices, in matrix order; cell_rows_of(shape): a stacked
    weight's one-pass cell rows, or None (one run per expert)."""
    runs, first = [], 0
    for index, slot in enumerate(slots):
        if not is_stacked(slot.shape):
            runs.append(Run(index, None, first, 1, slot.shape, None))
            first += 1
            continue
        experts = slot.shape[0]
        cell_rows = cell_rows_of(slot.shape)
        if cell_rows is not None:
            runs.append(Run(index, None, first, experts, slot.shape, cell_rows))
        else:
            shape = matrix_shape(slot.shape)
            runs += [Run(index, e, first + e, 1, shape, None) for e in range(experts)]
        first += experts
    return runs
