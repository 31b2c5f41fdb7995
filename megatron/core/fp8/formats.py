"""FP8 formats (E4M3, E5M2) and E8M0 scale helpers; which format each tensor role uses.

Rules: docs/FP8_NUMERICS.md ("Formats"). Everything here works on fp32 tensors on any
device and is bit-exact: no fast-math, no flush-to-zero assumptions.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)

FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
"""Largest finite value of each FP8 format."""

FLT_MAX = 3.4028234663852886e38
"""Largest finite fp32; an infinite scale becomes this (tensorwise and delayed recipes)."""

ROLES = ("input", "weight", "grad")

# E8M0 byte 255 is NaN; 254 is the largest finite exponent (2^127).
E8M0_NAN = 255
E8M0_MAX_FINITE = 254
# Mantissa of fp32 2^-127 (a subnormal): t <= 2^-127 is covered by E8M0 byte 0, which means 2^-127.
_HALF_SUBNORMAL_MANTISSA = 0x400000
_MANTISSA_MASK = 0x7FFFFF


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of `fp8_dtype`; raises for a dtype that is not an FP8 format."""
    check_fp8_dtype(fp8_dtype)
    return FP8_MAX[fp8_dtype]


def _fp32_reciprocal(value: float) -> float:
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(value, dtype=torch.float32))


# fp32(1 / fp8_max), correctly rounded (an fp32 division), computed once at import: a lookup
# is all torch.compile then traces (a tensor op turned into a Python float is a graph break).
_FP8_MAX_RECIPROCAL = {dtype: _fp32_reciprocal(limit) for dtype, limit in FP8_MAX.items()}


def fp8_max_reciprocal(fp8_dtype: torch.dtype) -> float:
    """fp32(1 / fp8_max), correctly rounded: the MXFP8 rule multiplies by this constant."""
    check_fp8_dtype(fp8_dtype)
    return _FP8_MAX_RECIPROCAL[fp8_dtype]


def check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_MAX:
        raise ValueError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}; "
            "pick one with megatron.core.fp8.formats.fp8_dtype_for_role()."
        )


def fp8_dtype_for_role(fp8_format: str, role: str) -> torch.dtype:
    """FP8 dtype of a tensor with `role` under `fp8_format` ("hybrid": E5M2 grads only)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if fp8_format == "e4m3":
        return E4M3
    if fp8_format == "hybrid":
        return E5M2 if role == "grad" else E4M3
    raise ValueError(f"fp8_format must be 'e4m3' or 'hybrid', got {fp8_format!r}")


def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of an fp32 tensor (a view, not a conversion)."""
    return x.contiguous().view(torch.int32)


def clear_mantissa(scale: torch.Tensor) -> torch.Tensor:
    """Round a positive fp32 scale down to a power of two by clearing its 23 mantissa bits.

    Rounding down means quantize(x * scale) can never saturate because of the rounding.
    """
    bits = fp32_bits(scale.to(torch.float32)) & ~_MANTISSA_MASK
    return bits.view(torch.float32).reshape(scale.shape)


def e8m0_from_t(t: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (uint8) = fp32 t rounded up to a power of two (mxfp8 step 3, NVIDIA rule).

    NaN -> 255; +Inf -> 254; 0 -> 0. Otherwise with E, m the exponent and mantissa fields of t:
    e = E + 1 when m > 0 and E != 254 and not (E == 0 and m <= 0x400000), else e = E.
    """
    t = t.to(torch.float32)
    bits = fp32_bits(t).reshape(t.shape)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & _MANTISSA_MASK
    # A subnormal t at most 2^-127 is already covered by byte 0 (which means 2^-127).
    small_subnormal = (exponent == 0) & (mantissa <= _HALF_SUBNORMAL_MANTISSA)
    round_up = (mantissa > 0) & (exponent != E8M0_MAX_FINITE) & ~small_subnormal
    e = exponent + round_up.to(torch.int32)
    e = torch.where(torch.isposinf(t), torch.full_like(e, E8M0_MAX_FINITE), e)
    e = torch.where(t == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isnan(t), torch.full_like(e, E8M0_NAN), e)
    return e.to(torch.uint8)


def e8m0_to_fp32(e: torch.Tensor, *, negate_exponent: bool = False) -> torch.Tensor:
    """Exactly 2^(e - 127) as fp32 (byte 0 -> 2^-127, 255 -> NaN); the dequantize multiplier.

    negate_exponent=True gives 2^(127 - e) instead, the quantize multiplier (mxfp8 step 4):
    byte 0 -> 2^127, 254 -> 2^-127, 255 -> NaN. Built from bits, so 2^-127 is an exact subnormal.
    """
    e = e.to(torch.int32)
    power = (127 - e) if negate_exponent else (e - 127)
    biased = power + 127
    normal_bits = biased.clamp(min=1, max=254) << 23
    # The only power that is not a normal fp32 is -127: subnormal with mantissa 0x400000.
    bits = torch.where(biased == 0, torch.full_like(e, _HALF_SUBNORMAL_MANTISSA), normal_bits)
    value = bits.view(torch.float32)
    return torch.where(e == E8M0_NAN, torch.full_like(value, float("nan")), value)
