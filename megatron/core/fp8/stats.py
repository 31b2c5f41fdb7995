"""FP8 statistics of one tensor under one recipe and role: what a user watches (issue 41).

`fp8_tensor_stats(x, recipe=, role=)`: the amax, the scale (or a summary of block scales), the
fraction that saturates and the fraction of non-zeros that flush to zero. A pure function of
the public API: scales derived exactly as `quantize` derives them, flushes read from the bytes
`quantize` wrote (or from a QuantizedTensor the caller has: no second cast).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from megatron.core.fp8.formats import fp8_dtype_for_role, fp8_max
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import block_scales, expand_grid


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


def _cell_amax(x2d: torch.Tensor, cell: tuple[int, int]) -> torch.Tensor:
    """max|x| (NaN as 0) of each [cell] block of x2d, zero-padded at the ends; grid-shaped."""
    rows, cols = x2d.shape
    cell_rows, cell_cols = cell
    grid_rows, grid_cols = -(-rows // cell_rows), -(-cols // cell_cols)
    magnitude = torch.nan_to_num(x2d.abs(), nan=0.0)
    padded = F.pad(magnitude, (0, grid_cols * cell_cols - cols, 0, grid_rows * cell_rows - rows))
    blocks = padded.reshape(grid_rows, cell_rows, grid_cols, cell_cols)
    return blocks.amax(dim=(1, 3))


def _multipliers(
    x2d: torch.Tensor,
    *,
    recipe: str,
    role: str,
    fp8_dtype: torch.dtype,
    input_dtype: torch.dtype,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    power_2_scale: bool | None,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """(grid of quantize multipliers, cell shape), as `quantize` computes them."""
    spec = recipe_spec(recipe)
    cell = spec.block_shape(role, columnwise=False) or tuple(x2d.shape)
    if spec.delayed:
        if scale is None:
            raise ValueError("recipe 'delayed' quantizes with its current scale: pass scale=")
        return scale.to(torch.float32).reshape(1, 1), cell
    cell_amax = _cell_amax(x2d, cell) if amax is None else amax.to(torch.float32).reshape(1, 1)
    multiplier, _ = block_scales(
        cell_amax,
        spec=spec,
        fp8_dtype=fp8_dtype,
        power_2_scale=spec.resolve_power_2_scale(power_2_scale),
        input_dtype=input_dtype,
    )
    return multiplier, cell


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
    caller already holds (e.g. Fp8Linear's saved operand); without it x is quantized here.
    """
    fp8_dtype = fp8_dtype_for_role(fp8_format, role)
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
    grid, cell = _multipliers(
        x2d,
        recipe=recipe,
        role=role,
        fp8_dtype=fp8_dtype,
        input_dtype=x.dtype,
        scale=scale,
        amax=amax,
        power_2_scale=power_2_scale,
    )
    scaled = x2d * expand_grid(grid, cell, x2d.shape)
    saturated = (scaled.abs() > fp8_max(fp8_dtype)).sum()
    if quantized is None:
        quantized = quantize(
            x,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role=role,
            scale=scale if recipe_spec(recipe).delayed else None,
            amax=amax,
            power_2_scale=power_2_scale,
        )
    dequantized = quantized.dequantize(torch.float32).reshape(x2d.shape)
    nonzero_mask = x2d != 0
    flat = grid.reshape(-1)
    parts = [
        torch.nan_to_num(x2d.abs(), nan=0.0).amax(),
        flat.median(),
        flat.amin(),
        flat.amax(),
        torch.tensor(flat.numel(), device=x.device),
        saturated,
        (nonzero_mask & (dequantized == 0)).sum(),
        nonzero_mask.sum(),
    ]
    # float64: counts stay exact up to 2^53 elements, fp32 amax and scales exactly.
    return torch.stack([part.to(torch.float64) for part in parts])


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
