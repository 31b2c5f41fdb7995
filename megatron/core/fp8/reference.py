"""Pure-PyTorch reference quantizers for every recipe: the bit-exact definition of FP8_NUMERICS.md.

Every fast path (megatron/core/fp8/cuda/) is tested against these with zero tolerance; they run
on any device, in fp32, and favour clarity over speed. Shared conventions: [..., K] is viewed
as [M, K] (rowwise blocks along K, columnwise along M); data is uint8 in x's shape; scale_inv
has the block-grid shape (`scale_grid_shape`); amax ignores NaN everywhere. Results are dicts
of rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv (None when not
requested) and amax (0-d fp32: the scale's amax, the recorded one for delayed, max|x| for blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fp8.formats import (
    FLT_MAX,
    ROLES,
    check_fp8_dtype,
    clear_mantissa,
    e8m0_from_t,
    e8m0_to_fp32,
    fp8_max,
    fp8_max_reciprocal,
)
from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.numerics import amax_ignoring_nan

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x ([..., K], fp32/bf16/fp16) as an fp32 [M, K] matrix; bad inputs raise."""
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"can only quantize fp32, bf16 or fp16 tensors, got {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}: need >= 1 element")
    return x.reshape(-1, x.shape[-1]).to(torch.float32)


def check_quantize_args(
    spec: RecipeSpec,
    *,
    role: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    power_2_scale: bool | None = None,
) -> None:
    """The argument rules of every quantize backend (FP8_NUMERICS.md API); raises ValueError."""
    recipe = spec.name
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
    if spec.delayed and scale is None:
        raise ValueError("recipe 'delayed' quantizes with its current scale: pass scale=")
    if not spec.delayed and scale is not None:
        raise ValueError(f"scale= is only for recipe 'delayed'; {recipe} computes its own scale")
    if amax is not None and not spec.accepts_global_amax:
        raise ValueError(
            f"amax= (a pre-reduced global amax) is only for 'tensorwise', not {recipe}"
        )
    if spec.delayed and power_2_scale:
        raise ValueError("delayed scaling never rounds scales: leave power_2_scale unset")
    if spec.e8m0_scales and power_2_scale is False:
        raise ValueError("mxfp8 E8M0 scales are always powers of two: leave power_2_scale unset")


def scale_grid_shape(
    rows: int, cols: int, *, recipe: str, role: str, columnwise: bool
) -> tuple[int, ...]:
    """Logical shape of scale_inv for an [rows, cols] tensor (FP8_NUMERICS.md, public API)."""
    cell = recipe_spec(recipe).block_shape(role, columnwise=columnwise)
    if cell is None:
        return ()
    cell_rows, cell_cols = cell
    return (-(-rows // cell_rows), -(-cols // cell_cols))


def saturating_cast(x_scaled: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """RN-even cast of fp32 to FP8 bytes, saturating: clamp first (an unclamped cast of a large
    value becomes NaN); +-Inf -> +-max, NaN stays NaN (clamp keeps NaN)."""
    limit = fp8_max(fp8_dtype)
    return x_scaled.clamp(min=-limit, max=limit).to(fp8_dtype).view(torch.uint8)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """fp32 1/scale, correctly rounded: divided in fp64 and rounded once to fp32, which equals
    the IEEE fp32 division (53 >= 2 x 24 + 2 bits) also where Inductor's fp32 `/` is not."""
    scale = scale.to(torch.float64)  # a tensor divided (a Python number / t is t.reciprocal() * n)
    return (torch.ones_like(scale) / scale).to(torch.float32)


def scale_from_amax(
    amax: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    power_2_scale: bool,
    infinite_scale_value: float = FLT_MAX,
) -> torch.Tensor:
    """Current-scaling scale = fp8_max / amax (fp32), elementwise over any amax shape.

    amax 0, Inf or NaN -> 1.0; an infinite quotient -> `infinite_scale_value` (FLT_MAX for
    tensorwise, the input dtype's largest finite value for blockwise); then optionally round
    down to a power of two.
    """
    amax = amax.to(torch.float32)
    usable = (amax > 0) & torch.isfinite(amax)
    denominator = torch.where(usable, amax, torch.ones_like(amax)).to(torch.float64)
    numerator = torch.full_like(denominator, fp8_max(fp8_dtype))
    scale = (numerator / denominator).to(torch.float32)  # the fp32 IEEE quotient: `reciprocal`
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, infinite_scale_value), scale)
    scale = torch.where(usable, scale, torch.ones_like(scale))
    if power_2_scale:
        scale = clear_mantissa(scale)
    return scale


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The MXFP8 scale byte of a block amax: t = amax * fp32(1/fp8_max) (a multiplication by the
    rounded reciprocal, not a division) rounded up to a power of two (`e8m0_from_t`)."""
    return e8m0_from_t(amax.to(torch.float32) * fp8_max_reciprocal(fp8_dtype))


def delayed_scale_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    margin: int,
    amax_compute_algo: str,
) -> torch.Tensor:
    """New delayed-scaling scale from a (reduced) amax history (FP8_NUMERICS.md, delayed, step 3).

    amax_history is [L] or [N, L] (slot 0 newest); scale is 0-d or [N]. Returns the new scale;
    it does not roll the history (see `roll_amax_history`).
    """
    if amax_compute_algo == "max":
        amax_used = amax_history.amax(dim=-1)
    elif amax_compute_algo == "most_recent":
        amax_used = amax_history[..., 0]
    else:
        raise ValueError(
            f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo}"
        )
    amax_used = amax_used.to(torch.float32)
    new_scale = torch.full_like(amax_used, fp8_max(fp8_dtype)) / amax_used
    new_scale = new_scale / (2.0**margin)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    usable = torch.isfinite(amax_used) & (amax_used > 0)
    return torch.where(usable, new_scale, scale.to(torch.float32).reshape(new_scale.shape))


def roll_amax_history(amax_history: torch.Tensor) -> torch.Tensor:
    """Slot k takes slot k+1, the oldest slot takes the newest, then slot 0 is zeroed."""
    rolled = torch.roll(amax_history, shifts=-1, dims=-1)
    # zero_(), not `rolled[..., 0] = 0.0`: assigning a Python number makes a CPU tensor and
    # copies it to the device, which synchronizes with a CUDA stream (once per weight and step
    # when the FSDP engine updated each weight's meta on its own).
    rolled.select(-1, 0).zero_()
    return rolled


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the end of each dim to [rows, cols] (zeros never raise an amax)."""
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


def quantize_per_tensor(
    x2d: torch.Tensor, *, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes [M, K] and 0-d scale_inv of a per-tensor quantization with a given scale."""
    scale = scale.to(torch.float32).reshape(())
    return saturating_cast(x2d * scale, fp8_dtype), reciprocal(scale)


def block_scales(
    block_amax: torch.Tensor,
    *,
    spec: RecipeSpec,
    fp8_dtype: torch.dtype,
    power_2_scale: bool,
    input_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize multiplier, stored scale_inv) per block (or cell) of a current-scaling recipe
    from its amax: mxfp8's E8M0 bytes, else fp8_max / amax with its guards."""
    if spec.e8m0_scales:
        e8m0 = e8m0_from_amax(block_amax, fp8_dtype)
        return e8m0_to_fp32(e8m0, negate_exponent=True), e8m0
    scale = scale_from_amax(
        block_amax,
        fp8_dtype=fp8_dtype,
        power_2_scale=power_2_scale,
        infinite_scale_value=spec.infinite_scale_value(input_dtype),
    )
    return scale, reciprocal(scale)


def quantize_blocks(
    x2d: torch.Tensor,
    *,
    cell: tuple[int, int],
    spec: RecipeSpec,
    fp8_dtype: torch.dtype,
    power_2_scale: bool,
    input_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes in x's shape and the scale grid (ceil(M/r), ceil(K/c)) of [r, c] cells: 1xB
    (rowwise), Bx1 (columnwise) or BxB (blockwise weights)."""
    rows, cols = x2d.shape
    cell_rows, cell_cols = cell
    padded = _pad_to(x2d, _ceil_to(rows, cell_rows), _ceil_to(cols, cell_cols))
    grid_rows, grid_cols = padded.shape[0] // cell_rows, padded.shape[1] // cell_cols
    blocks = padded.reshape(grid_rows, cell_rows, grid_cols, cell_cols)
    multiplier, scale_inv = block_scales(
        amax_ignoring_nan(blocks, dim=(1, 3)),
        spec=spec,
        fp8_dtype=fp8_dtype,
        power_2_scale=power_2_scale,
        input_dtype=input_dtype,
    )
    data = saturating_cast(blocks * multiplier[:, None, :, None], fp8_dtype)
    return data.reshape(padded.shape)[:rows, :cols].contiguous(), scale_inv.contiguous()


def quantize_reference(
    x: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool = True,
    columnwise: bool = False,
    scale: torch.Tensor | None = None,
    power_2_scale: bool = False,
    amax: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """Quantize x by the rules of FP8_NUMERICS.md; arguments already validated by `quantize`.

    delayed: uses `scale`. tensorwise: uses `amax` (a global amax) when given, else max|x|.
    Returns the dict described in the module docstring.
    """
    check_fp8_dtype(fp8_dtype)
    spec = recipe_spec(recipe)
    x2d = as_rows(x)
    out: dict[str, torch.Tensor | None] = dict(
        rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None
    )
    out["amax"] = amax_ignoring_nan(x2d)
    options = dict(spec=spec, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, input_dtype=x.dtype)
    if spec.per_tensor:
        if not spec.delayed:
            if amax is not None:
                out["amax"] = amax.to(torch.float32).reshape(())
            scale = scale_from_amax(out["amax"], fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
        data, scale_inv = quantize_per_tensor(x2d, scale=scale, fp8_dtype=fp8_dtype)
    elif spec.uses_2d_blocks(role):
        data, scale_inv = quantize_blocks(x2d, cell=(spec.block, spec.block), **options)
    else:
        for direction, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
            if wanted:
                cell = spec.block_shape(role, columnwise=direction == "columnwise")
                data, scale_inv = quantize_blocks(x2d, cell=cell, **options)
                out[f"{direction}_data"] = data.reshape(x.shape)
                out[f"{direction}_scale_inv"] = scale_inv
        return out
    # Per tensor and BxB cells: the same bytes and scale in both directions (the transposed
    # copy a GEMM wants is the transpose cache).
    data = data.reshape(x.shape)
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = data, scale_inv
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = data.clone(), scale_inv.clone()
    return out


def expand_grid(scale: torch.Tensor, cell: tuple[int, int], shape) -> torch.Tensor:
    """Repeat a block-grid scale to one value per element of a 2-D tensor of `shape`."""
    full = scale.repeat_interleave(cell[0], dim=0).repeat_interleave(cell[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_cells(
    q: torch.Tensor, scale_inv: torch.Tensor, cell: tuple[int, int] | None, *, e8m0: bool
) -> torch.Tensor:
    """fp32 q [M, K] times each element's scale_inv (cell None: one per tensor; e8m0: E8M0
    bytes), exact per fp32 arithmetic."""
    if cell is None:
        return q * scale_inv.to(torch.float32).reshape(())
    multiplier = e8m0_to_fp32(scale_inv.view(torch.uint8)) if e8m0 else scale_inv.to(torch.float32)
    return q * expand_grid(multiplier, cell, q.shape)


def dequantize_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    columnwise: bool,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q * scale_inv in fp32 per element (exact per fp32 arithmetic), cast to out_dtype."""
    check_fp8_dtype(fp8_dtype)
    shape = data.shape
    q = data.reshape(-1, shape[-1]).view(fp8_dtype).to(torch.float32)
    spec = recipe_spec(recipe)
    cell = spec.block_shape(role, columnwise=columnwise)
    return dequantize_cells(q, scale_inv, cell, e8m0=spec.e8m0_scales).to(out_dtype).reshape(shape)
