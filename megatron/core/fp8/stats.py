"""FP8 statistics of one tensor under one recipe and role: what a user watches (issue 41).

`fp8_tensor_stats(x, recipe=, role=)`: the amax, the scale (or a summary of block scales), the
fraction that saturates and the fraction of non-zeros that flush to zero. A pure function of
the public API: amaxes and scales derived by `quantize`'s rules (reference.py), flushes read
from the FP8 bytes of quantize's cast (`saturating_cast`), in bounded row chunks (cheap enough
for --log-fp8-stats to stay on: no full-size fp32 temporary, two reads of the tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from megatron.core.fp8.formats import fp8_dtype_for_role, fp8_max
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.fp8.reference import amax_ignoring_nan, block_scales, saturating_cast


@dataclass(frozen=True)
class Fp8TensorStats:
    """Statistics of one quantization (python numbers, ready for a log line or TensorBoard)."""

    recipe: str
    role: str
    fp8_dtype: str
    amax: float
    """max|x| over the tensor, NaN counted as 0."""
    scale: float
    """The quantize multiplier: per-tensor recipes its one value, block recipes the median."""
    scale_min: float
    scale_max: float
    num_scales: int
    saturated_fraction: float
    """Fraction of all elements with |x * scale| > fp8_max (the cast clamps them)."""
    underflow_fraction: float
    """Fraction of the non-zero elements whose quantized value is zero."""
    numel: int
    nonzero: int

    def as_dict(self) -> dict:
        return asdict(self)


CHUNK_ELEMENTS = 1 << 24
"""Elements of x one pass reads at a time: its fp32 temporaries stay <= 64 MiB each (a chunk
is at least one row of cells, so more only when one row of cells is larger)."""


def row_chunks(rows: int, cols: int, cell_rows: int) -> list[tuple[int, int]]:
    """(start, stop) row ranges covering [0, rows): whole rows of cells, <= CHUNK_ELEMENTS
    elements each when one row of cells fits."""
    step = max(1, CHUNK_ELEMENTS // (cols * cell_rows)) * cell_rows
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _as_blocks(chunk: torch.Tensor, cell: tuple[int, int]) -> torch.Tensor:
    """chunk [r, c] zero-padded to whole cells and viewed [grid_r, cell_r, grid_c, cell_c]
    (a view when it needs no padding; zeros never count)."""
    rows, cols = chunk.shape
    cell_rows, cell_cols = cell
    grid_rows, grid_cols = -(-rows // cell_rows), -(-cols // cell_cols)
    padded = F.pad(chunk, (0, grid_cols * cell_cols - cols, 0, grid_rows * cell_rows - rows))
    return padded.reshape(grid_rows, cell_rows, grid_cols, cell_cols)


def _stats_cell(spec: RecipeSpec, role: str, shape: tuple[int, int]) -> tuple[int, int]:
    """The cell one scale covers; per-tensor recipes: one row (chunks then split anywhere)."""
    return spec.block_shape(role, columnwise=False) or (1, shape[1])


FUSED_DEVICES = ("cuda",)
"""Device types where each chunk's pass is one torch.compile'd kernel (tests add "cpu")."""


def _fused(fn: Callable) -> Callable:
    """fn compiled where FUSED_DEVICES say (a few variants, compiled at the first statistics
    step; shapes go dynamic on the first new one), else eager. A statistics step runs the
    model under set_stance("force_eager"), so the call sets its own stance."""
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def run(chunk: torch.Tensor, *args):
        if chunk.device.type not in FUSED_DEVICES or torch.compiler.is_compiling():
            return fn(chunk, *args)
        with torch.compiler.set_stance("default"):
            return compiled(chunk, *args)

    return run


@_fused
def _chunk_amax(chunk: torch.Tensor, cell: tuple[int, int]) -> torch.Tensor:
    """max|x| (NaN as 0, as `quantize`) of each cell of one chunk."""
    return amax_ignoring_nan(_as_blocks(chunk, cell), dim=(1, 3))


def _cell_amax(x2d: torch.Tensor, spec: RecipeSpec, role: str) -> torch.Tensor:
    """Grid of max|x| per cell, chunk by chunk; per-tensor recipes: [1, 1]."""
    cell = _stats_cell(spec, role, x2d.shape)
    chunks = row_chunks(*x2d.shape, cell[0])
    grid = torch.cat([_chunk_amax(x2d[start:stop], cell) for start, stop in chunks])
    return grid.amax().reshape(1, 1) if spec.per_tensor else grid


def _multipliers(
    x2d: torch.Tensor,
    cell_amax: torch.Tensor,
    *,
    spec: RecipeSpec,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    power_2_scale: bool | None,
) -> torch.Tensor:
    """The grid of quantize multipliers ([1, 1] per tensor), as `quantize` computes them."""
    if spec.delayed:
        if scale is None:
            raise ValueError("recipe 'delayed' quantizes with its current scale: pass scale=")
        return scale.to(torch.float32).reshape(1, 1)
    multiplier, _ = block_scales(
        cell_amax if amax is None else amax.to(torch.float32).reshape(1, 1),
        spec=spec,
        fp8_dtype=fp8_dtype,
        power_2_scale=spec.resolve_power_2_scale(power_2_scale),
        input_dtype=x2d.dtype,
    )
    return multiplier


@_fused
def _chunk_counts(
    chunk: torch.Tensor, multiplier: torch.Tensor, cell: tuple[int, int], fp8_dtype: torch.dtype
) -> torch.Tensor:
    """[saturated, flushed, nonzero] of one chunk whose cells are multiplied by `multiplier`
    ([grid rows, grid cols], or [1, 1]): saturated |x * m| > fp8_max, flushed a non-zero x
    whose FP8 byte (`saturating_cast`, quantize's cast) is +-0."""
    blocks = _as_blocks(chunk, cell)
    scaled = blocks.to(torch.float32) * multiplier[:, None, :, None]
    saturated = (scaled.abs() > fp8_max(fp8_dtype)).sum()
    zero_byte = saturating_cast(scaled, fp8_dtype).bitwise_and(0x7F) == 0
    nonzero = blocks != 0
    return torch.stack([saturated, (nonzero & zero_byte).sum(), nonzero.sum()])


def _counts(
    x2d: torch.Tensor, grid: torch.Tensor, cell: tuple[int, int], fp8_dtype: torch.dtype
) -> torch.Tensor:
    """[saturated, flushed, nonzero] of x2d quantized with the multiplier grid, in one pass of
    row chunks (a per-tensor grid is one value for every cell)."""
    total = torch.zeros(3, dtype=torch.int64, device=x2d.device)
    for start, stop in row_chunks(*x2d.shape, cell[0]):
        rows = grid if grid.numel() == 1 else grid[start // cell[0] : -(-stop // cell[0])]
        total += _chunk_counts(x2d[start:stop], rows, cell, fp8_dtype)
    return total


def _counts_from_quantized(x2d: torch.Tensor, quantized: QuantizedTensor) -> torch.Tensor:
    """[-, flushed, nonzero] read from a QuantizedTensor the caller holds (its dequantized
    values: not the training path, which passes none)."""
    dequantized = quantized.dequantize(torch.float32).reshape(x2d.shape)
    nonzero = x2d != 0
    return torch.stack([(nonzero & (dequantized == 0)).sum(), nonzero.sum()])


STATS_FIELDS = (
    "amax",
    "scale",
    "scale_min",
    "scale_max",
    "num_scales",
    "saturated",
    "flushed",
    "nonzero",
)
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
    quantized: QuantizedTensor | None = None,
) -> torch.Tensor:
    """The float64 [len(STATS_FIELDS)] statistics of quantizing x rowwise under recipe and role,
    on x's device with no host sync (a loop stacks every Linear's vectors, one `.tolist()`).
    scale, amax, power_2_scale: as in `quantize`. quantized: the rowwise QuantizedTensor of x the
    caller already holds; without it the FP8 bytes are cast here, chunk by chunk, by quantize's
    rule (`saturating_cast` of x times the same multipliers). Two reads of x (amaxes, then the
    counts), with temporaries bounded by CHUNK_ELEMENTS: no full-size fp32 copy.
    """
    spec = recipe_spec(recipe)
    fp8_dtype = fp8_dtype_for_role(fp8_format, role)
    x2d = x.reshape(-1, x.shape[-1])
    cell_amax = _cell_amax(x2d, spec, role)
    grid = _multipliers(
        x2d,
        cell_amax,
        spec=spec,
        fp8_dtype=fp8_dtype,
        scale=scale,
        amax=amax,
        power_2_scale=power_2_scale,
    )
    counts = _counts(x2d, grid, _stats_cell(spec, role, x2d.shape), fp8_dtype)
    if quantized is not None:
        counts = torch.cat([counts[:1], _counts_from_quantized(x2d, quantized)])
    flat = grid.reshape(-1)
    parts = [
        cell_amax.amax(),
        flat.median(),
        flat.amin(),
        flat.amax(),
        torch.tensor(flat.numel(), device=x.device),
    ]
    # float64: counts stay exact up to 2^53 elements, fp32 amax and scales exactly.
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
        amax=field["amax"],
        scale=field["scale"],
        scale_min=field["scale_min"],
        scale_max=field["scale_max"],
        num_scales=int(field["num_scales"]),
        saturated_fraction=field["saturated"] / numel,
        underflow_fraction=field["flushed"] / nonzero if nonzero else 0.0,
        numel=numel,
        nonzero=int(nonzero),
    )


def fp8_tensor_stats(x: torch.Tensor, **options) -> Fp8TensorStats:
    """`fp8_stats_vector(x, **options)` read back (one host sync) as an Fp8TensorStats."""
    vector = fp8_stats_vector(x, **options)
    fp8_format = options.get("fp8_format", "hybrid")
    return stats_from_vector(
        vector.tolist(),
        recipe=options["recipe"],
        role=options["role"],
        fp8_format=fp8_format,
        numel=x.numel(),
    )
