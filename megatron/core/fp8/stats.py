"""FP8 statistics of one tensor under one recipe and role: what a user watches (issue 41).

`fp8_tensor_stats(x, recipe=, role=)`: the amax, the scale (or a summary of several), the
fractions that saturate and that flush to zero, by `quantize`'s rules (reference.py) and cast
(`saturating_cast`), in bounded row chunks: no full-size fp32 temporary, two reads of x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core import fused_pass
from megatron.core.fp8.formats import fp8_dtype_for_role, fp8_max
from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.fp8.reference import block_scales, saturating_cast
from megatron.core.numerics import amax_ignoring_nan


@dataclass(frozen=True)
class Fp8TensorStats:
    """Statistics of one quantization (python numbers, for a log line or TensorBoard): amax
    max|x| (NaN as 0); scale the quantize multiplier (several: their median, over the cells
    that are not all zero); the saturated fraction of all elements (those the cast's clamp
    changes: `saturation_bound`); the underflow fraction of the non-zero elements (quantized
    to zero)."""

    recipe: str
    role: str
    fp8_dtype: str
    amax: float
    scale: float
    scale_min: float
    scale_max: float
    num_scales: int
    saturated_fraction: float
    underflow_fraction: float
    numel: int
    nonzero: int


CHUNK_ELEMENTS = 1 << 24
"""Elements one pass reads at a time: fp32 temporaries <= 64 MiB (a chunk >= one row of cells)."""


def row_chunks(rows: int, cols: int, cell_rows: int, limit: int = CHUNK_ELEMENTS) -> list:
    """(start, stop) ranges of whole rows of cells, <= limit elements where one row fits."""
    step = max(1, limit // (cols * cell_rows)) * cell_rows
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _as_blocks(chunk: torch.Tensor, cell: tuple[int, int]) -> torch.Tensor:
    """chunk [r, c] zero-padded to whole cells (zeros never count), as [gr, cell_r, gc, cell_c]."""
    (rows, cols), (cell_rows, cell_cols) = chunk.shape, cell
    grid_rows, grid_cols = -(-rows // cell_rows), -(-cols // cell_cols)
    padded = F.pad(chunk, (0, grid_cols * cell_cols - cols, 0, grid_rows * cell_rows - rows))
    return padded.reshape(grid_rows, cell_rows, grid_cols, cell_cols)


@fused_pass.fused
def _chunk_amax(chunk: torch.Tensor, cell: tuple[int, int]) -> torch.Tensor:
    return amax_ignoring_nan(_as_blocks(chunk, cell), dim=(1, 3))  # NaN as 0, as `quantize`


def saturation_bound(fp8_dtype: torch.dtype) -> tuple[float, bool]:
    """(bound, ties_saturate): |x * m| past fp8_max + half its ulp would round past the format's
    largest value, so the cast's clamp changes it (between fp8_max and the bound the clamped
    byte is the rounded one). At the bound itself round-to-nearest-even goes up when fp8_max's
    last mantissa bit is odd (E5M2: 57344 -> 65536), down when it is even (E4M3: 448)."""
    largest = fp8_max(fp8_dtype)
    ulp = 2.0 ** math.floor(math.log2(largest)) * torch.finfo(fp8_dtype).eps
    return largest + ulp / 2, (largest / ulp) % 2 == 1


@fused_pass.fused
def _chunk_counts(chunk, multiplier, cell: tuple[int, int], fp8_dtype) -> torch.Tensor:
    """[saturated, flushed, nonzero] of a chunk whose cells quantize with `multiplier` (its grid
    rows, or [1, 1]): values the clamp changes (`saturation_bound`), and non-zeros whose byte
    (`saturating_cast`) is +-0."""
    blocks = _as_blocks(chunk, cell)
    scaled = blocks.to(torch.float32) * multiplier[:, None, :, None]
    bound, ties_saturate = saturation_bound(fp8_dtype)
    saturated = (scaled.abs() >= bound if ties_saturate else scaled.abs() > bound).sum()
    zero_byte = saturating_cast(scaled, fp8_dtype).bitwise_and(0x7F) == 0
    return torch.stack([saturated, (blocks.ne(0) & zero_byte).sum(), blocks.ne(0).sum()])


def _amaxes_and_multipliers(x2d, spec: RecipeSpec, cell, chunks, fp8_dtype, *options):
    """(max|x| per cell, the quantize multipliers per cell, the scales used): per tensor [1, 1],
    or under segments per row, each its segment's (NaN among those used: an empty segment)."""
    scale, amax, power_2_scale, segments = options
    cell_amax = torch.cat([_chunk_amax(x2d[start:stop], cell) for start, stop in chunks])
    ids = None
    if spec.per_tensor and segments is not None and not spec.delayed:  # rows [rows, 1]
        sizes = segments.to(device=x2d.device, dtype=torch.int64).reshape(-1)
        ids = torch.repeat_interleave(sizes, output_size=len(x2d))  # each row's segment
        cell_amax = cell_amax.new_zeros(len(sizes)).scatter_reduce(0, ids, cell_amax[:, 0], "amax")
    elif spec.per_tensor:
        cell_amax = cell_amax.amax().reshape(1, 1)
    if spec.delayed:
        if scale is None:
            raise ValueError("recipe 'delayed' quantizes with its current scale: pass scale=")
        multiplier = scale.to(torch.float32).reshape(1, 1)
    else:
        multiplier, _ = block_scales(
            cell_amax if amax is None else amax.to(torch.float32).reshape(1, 1),
            spec=spec,
            fp8_dtype=fp8_dtype,
            power_2_scale=spec.resolve_power_2_scale(power_2_scale),
            input_dtype=x2d.dtype,
        )
    if ids is None:
        return cell_amax, multiplier, multiplier.reshape(-1)
    return cell_amax, multiplier[ids, None], multiplier.where(sizes > 0, float("nan"))


STATS_FIELDS = ("amax", "scale", "scale_min", "scale_max", "num_scales")
STATS_FIELDS += ("saturated", "flushed", "nonzero")
"""The entries of `fp8_stats_vector`'s result, in order (counts, not fractions)."""


def fp8_stats_vector(
    x: torch.Tensor,
    *,
    recipe: str,
    role: str,
    fp8_format: str = "hybrid",
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    power_2_scale: bool | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float64 [len(STATS_FIELDS)] statistics (counts exact to 2^53) of quantizing x
    rowwise under recipe and role, on x's device with no host sync (a loop stacks every
    Linear's vectors, one `.tolist()`). scale, amax, power_2_scale: as in `quantize`. Two reads
    of x in row chunks (amaxes, then counts; no full-size temporary), cast by quantize's rule.
    segments: row counts of consecutive rows a current per-tensor recipe quantizes alone (the
    routed experts'); one-row cells ignore them, taller ones (weights) refuse them.
    """
    spec, fp8_dtype = recipe_spec(recipe), fp8_dtype_for_role(fp8_format, role)
    x2d = x.reshape(-1, x.shape[-1])
    cell = spec.block_shape(role, columnwise=False) or (1, x2d.shape[1])  # per tensor: by rows
    chunks = [(0, len(x2d))] if fused_pass.fused_on(x.device) else row_chunks(*x2d.shape, cell[0])
    if segments is not None and (cell[0] > 1 or amax is not None):  # amax: one for all rows
        raise ValueError(f"{recipe} {role}: segments take no amax= and no {cell[0]}-row cells")
    options = (scale, amax, power_2_scale, segments)
    cell_amax, grid, flat = _amaxes_and_multipliers(x2d, spec, cell, chunks, fp8_dtype, *options)
    counts = torch.zeros(3, dtype=torch.int64, device=x.device)
    for start, stop in chunks:
        rows = grid if grid.numel() == 1 else grid[start // cell[0] : -(-stop // cell[0])]
        counts += _chunk_counts(x2d[start:stop], rows, cell, fp8_dtype)
    used = ~flat.isnan()  # the scales quantize used: NaN for an empty segment's
    # An all-zero cell's scale (1) says nothing of the data: left out while any cell is not.
    nonzero_cells = used & (cell_amax.reshape(-1) > 0)
    used = torch.where(nonzero_cells.any(), nonzero_cells, used)
    low, high = flat.where(used, float("inf")).amin(), flat.where(used, float("-inf")).amax()
    parts = [cell_amax.amax(), flat.where(used, float("nan")).nanmedian(), low, high, used.sum()]
    return torch.cat([torch.stack([p.to(torch.float64) for p in parts]), counts.double()])


def stats_from_vector(
    values: list[float], *, recipe: str, role: str, fp8_format: str, numel: int
) -> Fp8TensorStats:
    """An Fp8TensorStats from `fp8_stats_vector(...).tolist()` of a tensor of numel elements."""
    field = dict(zip(STATS_FIELDS, values))
    nonzero = field["nonzero"]
    return Fp8TensorStats(
        recipe=recipe,
        role=role,
        fp8_dtype=str(fp8_dtype_for_role(fp8_format, role)).removeprefix("torch."),
        **{name: field[name] for name in ("amax", "scale", "scale_min", "scale_max")},
        num_scales=int(field["num_scales"]),
        saturated_fraction=field["saturated"] / numel,
        underflow_fraction=field["flushed"] / nonzero if nonzero else 0.0,
        numel=numel,
        nonzero=int(nonzero),
    )


def fp8_tensor_stats(x: torch.Tensor, **options) -> Fp8TensorStats:
    """`fp8_stats_vector(x, **options)` read back (one host sync) as an Fp8TensorStats."""
    vector = fp8_stats_vector(x, **options).tolist()
    role, fp8_format = options["role"], options.get("fp8_format", "hybrid")
    return stats_from_vector(
        vector, recipe=options["recipe"], role=role, fp8_format=fp8_format, numel=x.numel()
    )
