"""FP8 quantization of weight pieces: the flat range [param_start, param_start + numel) of a
row-major [M, K] weight that a data-parallel rank holds, possibly starting and ending mid-row.

Two passes (`megatron/core/distributed/fsdp/fp8_storage.py`): the partial amax of every scale
cell the piece touches (the caller MAX-reduces them across ranks), then the cast with each
cell's multiplier (cells: FP8_NUMERICS.md, "Scale tensors"). With Triton each pass is one kernel
over cell-aligned tiles, one atomic max per cell (a per-element scatter into one cell would
serialize on it); elsewhere the torch twin maps each element to its cell. Both are bitwise equal.
Pieces of whole 32-row bands (aligned mxfp8) own their cells: `quantize_mxfp8_rows_`, one pass.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda import quantize_mxfp8 as qmx
from megatron.core.fp8.cuda.launch import ceil_div
from megatron.core.fp8.formats import fp8_max
from megatron.core.fp8.recipe import MX_BLOCK, RecipeSpec, recipe_spec
from megatron.core.fp8.reference import saturating_cast
from megatron.core.numerics import amax_ignoring_nan

WHOLE = 1 << 30
"""A cell edge longer than any weight dim: the one cell of a per-tensor weight."""
TILE_ROWS, TILE_COLS = 32, 128
"""Kernel tile: a multiple or a divisor of every cell edge, so tiles never straddle cells in
a way the in-register reduction cannot express."""


def rows_cols(shape: torch.Size) -> tuple[int, int]:
    """(M, K) of the 2-D view a weight is quantized in (leading dims fold into rows)."""
    cols = shape[-1] if len(shape) else 1
    return shape.numel() // max(cols, 1), cols


def cell_shape(recipe: str, *, columnwise: bool, rows: int | None = None) -> tuple[int, int]:
    """(rows, cols) of one scale cell of a weight under `recipe`, in the given direction; rows:
    a cell's rows instead (a multiple of TILE_ROWS: a stacked expert weight [E, N, K] under a
    per-tensor recipe, quantized in one pass, is E cells of N rows)."""
    cell = recipe_spec(recipe).block_shape("weight", columnwise=columnwise)
    if rows is not None and rows % TILE_ROWS:
        raise ValueError(f"cell rows must be a multiple of {TILE_ROWS}, got {rows}")
    return (rows or WHOLE, WHOLE) if cell is None else (rows or cell[0], cell[1])


def stacked_cell_rows(shape: torch.Size, spec: RecipeSpec) -> int | None:
    """The cell rows with which a stacked expert weight [E, N, K], seen as its [E * N, K] rows,
    has each expert's own cells (per-tensor: N; block recipes: their block's rows when these
    divide N), so one pass quantizes every expert; None: no such cell (one pass per expert)."""
    block = spec.block_shape("weight", columnwise=False)
    rows = shape[-2] if block is None else block[0]
    return rows if shape[-2] % rows == 0 and rows % TILE_ROWS == 0 else None


def _grid(shape: torch.Size, cell: tuple[int, int]) -> tuple[int, int]:
    rows, cols = rows_cols(shape)
    return ceil_div(rows, cell[0]), ceil_div(cols, cell[1])


def grid_dims(
    shape: torch.Size, *, recipe: str, columnwise: bool, cell_rows=None
) -> tuple[int, int]:
    """(rows, cols) of the cell grid; its row-major flattening is the scale_inv layout."""
    return _grid(shape, cell_shape(recipe, columnwise=columnwise, rows=cell_rows))


def cell_geometry(shape: torch.Size, recipe: str, *, cell_rows=None) -> tuple[int, int, int, int]:
    """(cols, cell rows, cell cols, grid cols) of a weight's rowwise cells: element i of the
    row-major weight lies in cell (i // cols // cell rows) * grid cols + i % cols // cell cols."""
    cell = cell_shape(recipe, columnwise=False, rows=cell_rows)
    return rows_cols(shape)[1], cell[0], cell[1], _grid(shape, cell)[1]


def cell_index(shape: torch.Size, cell: tuple[int, int], *, param_start: int, numel: int, device):
    """Flat grid cell of each element param_start .. param_start + numel of the weight."""
    flat = torch.arange(param_start, param_start + numel, device=device)
    _, cols = rows_cols(shape)
    return (flat // cols // cell[0]) * _grid(shape, cell)[1] + (flat % cols) // cell[1]


def _launch_geometry(shape: torch.Size, *, param_start: int, numel: int) -> tuple[int, tuple]:
    """(first tile row, 1-D grid): cell-aligned tiles over the rows a piece touches."""
    _, cols = rows_cols(shape)
    first_row = param_start // cols
    last_row = (param_start + numel - 1) // cols
    row_base = first_row // TILE_ROWS * TILE_ROWS
    row_tiles = ceil_div(last_row + 1 - row_base, TILE_ROWS)
    return row_base, (row_tiles * ceil_div(cols, TILE_COLS),)


def _checked_grid(cells: torch.Tensor, what: str, shape, cell) -> tuple[int, int]:
    """The cell grid's (rows, cols), after checking that `cells` is an fp32 value per cell."""
    grid_rows, grid_cols = _grid(shape, cell)
    if cells.dtype != torch.float32 or cells.numel() != grid_rows * grid_cols:
        raise ValueError(f"{what} must be fp32 with {grid_rows * grid_cols} cells")
    return grid_rows, grid_cols


def _check_piece(values: torch.Tensor, shape: torch.Size, param_start: int) -> None:
    if values.dim() != 1 or not values.is_contiguous():
        raise ValueError("a weight piece is a contiguous 1-D slice of a flat buffer")
    if param_start < 0 or param_start + values.numel() > shape.numel():
        raise ValueError(
            f"piece [{param_start}, {param_start + values.numel()}) is outside a weight of "
            f"{shape.numel()} elements"
        )


@torch.no_grad()
def piece_cell_amax_(
    values: torch.Tensor,
    cell_amax: torch.Tensor,
    *,
    shape: torch.Size,
    spec: RecipeSpec,
    columnwise: bool,
    param_start: int,
    cell_rows: int | None = None,
) -> None:
    """Max into `cell_amax` (fp32, >= 0, the weight's flattened cell grid) the NaN-ignoring
    max|x| of each cell over the piece `values` (elements param_start.. of the weight).
    cell_rows: `cell_shape`'s rows."""
    cell = cell_shape(spec.name, columnwise=columnwise, rows=cell_rows)
    _check_piece(values, shape, param_start)
    grid_rows, grid_cols = _checked_grid(cell_amax, "cell_amax", shape, cell)
    numel = values.numel()
    if numel == 0:
        return
    if qc.use_triton(values):
        row_base, grid = _launch_geometry(shape, param_start=param_start, numel=numel)
        qc.triton_kernels().piece_amax_kernel[grid](
            values,
            cell_amax.view(torch.int32),
            param_start,
            numel,
            rows_cols(shape)[1],
            row_base,
            grid_rows,
            grid_cols,
            CR=cell[0],
            CC=cell[1],
            RG=max(TILE_ROWS // cell[0], 1),
            CG=max(TILE_COLS // cell[1], 1),
            TR=TILE_ROWS,
            TC=TILE_COLS,
            num_warps=4,
        )
        return
    magnitude = amax_ignoring_nan(values.reshape(1, -1), dim=0)
    if grid_rows * grid_cols == 1:
        cell_amax.copy_(torch.maximum(cell_amax.reshape(()), magnitude.amax()).reshape(1))
        return
    cells = cell_index(shape, cell, param_start=param_start, numel=numel, device=values.device)
    cell_amax.scatter_reduce_(0, cells, magnitude, reduce="amax", include_self=True)


@torch.no_grad()
def piece_cast_(
    values: torch.Tensor,
    multiplier: torch.Tensor,
    out: torch.Tensor,
    *,
    shape: torch.Size,
    spec: RecipeSpec,
    columnwise: bool,
    param_start: int,
    fp8_dtype: torch.dtype,
    cell_rows: int | None = None,
) -> None:
    """out (uint8, one byte per element of `values`) = the FP8 bytes of values times the
    quantize multiplier of each element's cell (`multiplier`: fp32, the flattened grid).
    cell_rows: `cell_shape`'s rows."""
    cell = cell_shape(spec.name, columnwise=columnwise, rows=cell_rows)
    _check_piece(values, shape, param_start)
    if out.dtype != torch.uint8 or out.shape != values.shape or not out.is_contiguous():
        raise ValueError("out must be a contiguous uint8 tensor shaped like the piece")
    # A delayed scale can still live on the CPU (its Fp8Linear moves it at the first forward).
    multiplier = multiplier.reshape(-1).to(values.device)
    grid_rows, grid_cols = _checked_grid(multiplier, "multiplier", shape, cell)
    numel = values.numel()
    if numel == 0:
        return
    if qc.use_triton(values):
        row_base, grid = _launch_geometry(shape, param_start=param_start, numel=numel)
        qc.triton_kernels().piece_cast_kernel[grid](
            values,
            out,
            multiplier.contiguous(),
            param_start,
            numel,
            rows_cols(shape)[1],
            row_base,
            grid_cols,
            FP8_MAX=fp8_max(fp8_dtype),
            E4M3=fp8_dtype == torch.float8_e4m3fn,
            CR=cell[0],
            CC=cell[1],
            TR=TILE_ROWS,
            TC=TILE_COLS,
            num_warps=4,
        )
        return
    if grid_rows * grid_cols == 1:
        per_element = multiplier.reshape(())
    else:
        where = dict(param_start=param_start, numel=numel, device=values.device)
        per_element = multiplier[cell_index(shape, cell, **where)]
    out.copy_(saturating_cast(values * per_element, fp8_dtype))


@torch.no_grad()
def quantize_mxfp8_rows_(
    values2d: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    row_data: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_data: torch.Tensor | None,
    col_scale: torch.Tensor | None,
) -> None:
    """MXFP8 rowwise (1x32) and columnwise (32x1) bytes and E8M0 scales of whole 32-row bands
    of a weight ([rows, K], rows and K multiples of 32), written into the given views:
    data [rows, K] uint8, row_scale [rows, K/32], col_scale [rows/32, K]. A direction whose
    data is None is not written."""
    rows, cols = values2d.shape
    if rows % MX_BLOCK or cols % MX_BLOCK:
        raise ValueError(f"whole MX bands need rows and cols divisible by 32, got {rows}x{cols}")
    if rows == 0:
        return
    if qc.use_triton(values2d):
        qmx.launch_mxfp8(
            values2d,
            row=row_data,
            row_e=row_scale,
            col=col_data,
            col_e=col_scale,
            col_t=None,
            record_bits=None,
            fp8_dtype=fp8_dtype,
            dequant=False,
        )
        return
    for along_rows, data, scale in ((True, row_data, row_scale), (False, col_data, col_scale)):
        if data is None:
            continue
        quantized, e8m0 = qmx.mxfp8_copy_torch(values2d, fp8_dtype, not along_rows)
        data.copy_(quantized)
        scale.copy_(e8m0)
