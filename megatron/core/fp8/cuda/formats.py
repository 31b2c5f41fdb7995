"""FP8 constants shared by the Triton kernels, the torch fallback and the GEMM wrapper.

Rules: docs/FP8_NUMERICS.md. Every constant here is an exact fp32 value, so that
passing it to Triton as a Python float (materialised as fp32) loses nothing.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.fp8.recipe import recipe_spec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ROLES = ("input", "weight", "grad")

# Blockwise (DeepSeek-V3) block edge and the MX block length.
BLOCK_128 = 128
MX_BLOCK = 32

FLT_MAX = torch.finfo(torch.float32).max
# IEEE fp32 bit patterns the kernels build scales from.
FP32_EXPONENT_MASK = 0x7F800000
FP32_INF_BITS = 0x7F800000
# 2^-127 is below the smallest normal fp32, so it is a subnormal: mantissa bit 22 alone.
FP32_TWO_POW_MINUS_127_BITS = 0x00400000
FP32_QUIET_NAN_BITS = 0x7FC00000


@functools.cache
def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def _fp32_reciprocal(value: float) -> float:
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(value, dtype=torch.float32))


# fp32(1 / fp8_max), correctly rounded (an fp32 division), computed once at import: a lookup
# is all torch.compile then traces (a tensor op turned into a Python float is a graph break).
_FP8_MAX_RECIPROCAL = {
    dtype: _fp32_reciprocal(float(torch.finfo(dtype).max)) for dtype in FP8_DTYPES
}


def fp8_max_reciprocal(fp8_dtype: torch.dtype) -> float:
    """fp32(1 / fp8_max), correctly rounded: the MXFP8 rule multiplies by this constant."""
    check_fp8_dtype(fp8_dtype)
    return _FP8_MAX_RECIPROCAL[fp8_dtype]


@functools.cache
def infinite_scale_replacement(*, recipe: str, input_dtype: torch.dtype) -> float:
    """What an infinite scale becomes: FLT_MAX for per-tensor recipes, the largest finite
    value of the input dtype for blockwise (FP8_NUMERICS.md, both rules verbatim)."""
    return recipe_spec(recipe).infinite_scale_value(input_dtype)


def check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def as_2d_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the 2-D view quantization works on: leading dims fold into rows."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    return rows, cols
