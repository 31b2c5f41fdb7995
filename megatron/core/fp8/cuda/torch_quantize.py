"""Plain-PyTorch quantization with the exact rules of FP8_NUMERICS.md.

This is the fallback `quantize_cuda` uses when Triton is missing (and on CPU tensors). It is
unfused and slow; the Triton kernels in `triton_quantize.py` must be bitwise equal to it.
All arithmetic is fp32 and every division is a tensor/tensor division: `python_float /
tensor` would become reciprocal-then-multiply in PyTorch and round twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fp8.cuda.formats import (
    BLOCK_128,
    FP32_EXPONENT_MASK,
    FP32_QUIET_NAN_BITS,
    FP32_TWO_POW_MINUS_127_BITS,
    MX_BLOCK,
    ceil_div,
    fp8_max,
    fp8_max_reciprocal,
)


def nan_ignoring_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0, so that NaN never raises an amax (Inf still does)."""
    return torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())


def scale_from_amax(
    amax: torch.Tensor, *, fp8_dtype: torch.dtype, inf_scale: float, power_2_scale: bool
) -> torch.Tensor:
    """scale = fp8_max / amax; amax 0, Inf or NaN -> 1.0; Inf scale -> inf_scale; optional
    power-of-two rounding by clearing the mantissa (rounds down, never saturates)."""
    amax = amax.float()
    usable = (amax > 0) & torch.isfinite(amax)
    numerator = torch.full_like(amax, fp8_max(fp8_dtype))
    raw = numerator / torch.where(usable, amax, torch.ones_like(amax))
    raw = torch.where(torch.isinf(raw), torch.full_like(raw, inf_scale), raw)
    scale = torch.where(usable, raw, torch.ones_like(raw))
    if power_2_scale:
        scale = (scale.view(torch.int32) & FP32_EXPONENT_MASK).view(torch.float32)
    return scale


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """fp32 1/scale, correctly rounded (a true division, not a reciprocal approximation)."""
    return torch.ones_like(scale) / scale


def saturating_cast(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8 bytes: clamp to +-max first (NaN stays NaN), then round to nearest even."""
    limit = fp8_max(fp8_dtype)
    return y.clamp(min=-limit, max=limit).to(fp8_dtype).view(torch.uint8)


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The MXFP8 scale byte: t = amax * fp32(1/fp8_max) rounded up to a power of two."""
    t = amax.float() * fp8_max_reciprocal(fp8_dtype)
    bits = t.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = torch.where(round_up, exponent + 1, exponent)
    e = torch.where(exponent == 255, torch.where(mantissa != 0, 255, 254), e)
    return e.to(torch.uint8)


def e8m0_multiplier(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2^(127 - e) in fp32, built from bits (e = 254 gives the subnormal 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 254, FP32_TWO_POW_MINUS_127_BITS, (254 - e) << 23)
    bits = torch.where(e == 255, FP32_QUIET_NAN_BITS, bits)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_dequant_multiplier(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2^(e - 127); byte 0 means 2^-127 (subnormal) and 255 means NaN."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, FP32_TWO_POW_MINUS_127_BITS, e << 23)
    bits = torch.where(e == 255, FP32_QUIET_NAN_BITS, bits)
    return bits.to(torch.int32).view(torch.float32)


def _pad_2d(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D fp32 tensor to (rows, cols); zeros never raise a block amax."""
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quantize_per_tensor(
    x2d: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes and scale_inv of one per-tensor scaled 2-D tensor."""
    scale = scale.float().reshape(())
    data = saturating_cast(x2d.float() * scale, fp8_dtype)
    return data, reciprocal(scale)


def quantize_1x128(
    x2d: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    inf_scale: float,
    power_2_scale: bool,
    along_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 blocks along the last dim (along_rows) or 128x1 blocks along dim 0."""
    x = x2d.float()
    rows, cols = x.shape
    if not along_rows:
        data_t, scale_inv_t = quantize_1x128(
            x.t(),
            fp8_dtype=fp8_dtype,
            inf_scale=inf_scale,
            power_2_scale=power_2_scale,
            along_rows=True,
        )
        return data_t.t().contiguous(), scale_inv_t.t().contiguous()
    blocks = ceil_div(cols, BLOCK_128)
    x_blocks = _pad_2d(x, rows, blocks * BLOCK_128).view(rows, blocks, BLOCK_128)
    amax = nan_ignoring_abs(x_blocks).amax(dim=2)
    scale = scale_from_amax(
        amax, fp8_dtype=fp8_dtype, inf_scale=inf_scale, power_2_scale=power_2_scale
    )
    data = saturating_cast(x_blocks * scale[:, :, None], fp8_dtype)
    return data.view(rows, -1)[:, :cols].contiguous(), reciprocal(scale)


def quantize_128x128(
    x2d: torch.Tensor, *, fp8_dtype: torch.dtype, inf_scale: float, power_2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks; scale grid (ceil(M/128), ceil(K/128))."""
    x = x2d.float()
    rows, cols = x.shape
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    padded = _pad_2d(x, row_blocks * BLOCK_128, col_blocks * BLOCK_128)
    tiles = padded.view(row_blocks, BLOCK_128, col_blocks, BLOCK_128)
    amax = nan_ignoring_abs(tiles).amax(dim=(1, 3))
    scale = scale_from_amax(
        amax, fp8_dtype=fp8_dtype, inf_scale=inf_scale, power_2_scale=power_2_scale
    )
    data = saturating_cast(tiles * scale[:, None, :, None], fp8_dtype)
    data = data.view(padded.shape)[:rows, :cols].contiguous()
    return data, reciprocal(scale)


def quantize_mxfp8(
    x2d: torch.Tensor, *, fp8_dtype: torch.dtype, along_rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x32 blocks along the last dim (along_rows) or 32x1 along dim 0; E8M0 scale bytes."""
    x = x2d.float()
    if not along_rows:
        data_t, e_t = quantize_mxfp8(x.t(), fp8_dtype=fp8_dtype, along_rows=True)
        return data_t.t().contiguous(), e_t.t().contiguous()
    rows, cols = x.shape
    blocks = ceil_div(cols, MX_BLOCK)
    x_blocks = _pad_2d(x, rows, blocks * MX_BLOCK).view(rows, blocks, MX_BLOCK)
    e = e8m0_from_amax(nan_ignoring_abs(x_blocks).amax(dim=2), fp8_dtype)
    data = saturating_cast(x_blocks * e8m0_multiplier(e)[:, :, None], fp8_dtype)
    return data.view(rows, -1)[:, :cols].contiguous(), e
