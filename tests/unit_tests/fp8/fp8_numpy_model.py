"""An independent numpy model of docs/FP8_NUMERICS.md, used only as the tests' source of truth.

Written from the spec without calling megatron code: FP8 values are decoded from their bit
fields, casts search the value table (round to nearest, ties to the even code), and scales use
numpy fp32 arithmetic (IEEE, subnormals kept).
"""

from __future__ import annotations

import math
import struct

import numpy as np

F32 = np.float32
FMT = {  # name: (exponent bits, mantissa bits, bias, max finite)
    "e4m3": (4, 3, 7, 448.0),
    "e5m2": (5, 2, 15, 57344.0),
}


def decode_table(fmt: str) -> np.ndarray:
    """fp64 value of each of the 256 bytes (NaN where the code is NaN, Inf for E5M2 Inf)."""
    ebits, mbits, bias, _ = FMT[fmt]
    values = np.empty(256)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp = (byte >> mbits) & ((1 << ebits) - 1)
        man = byte & ((1 << mbits) - 1)
        if fmt == "e4m3" and exp == 15 and man == 7:
            values[byte] = math.nan
        elif fmt == "e5m2" and exp == 31:
            values[byte] = math.nan if man else sign * math.inf
        elif exp == 0:
            values[byte] = sign * man * 2.0 ** (1 - bias - mbits)
        else:
            values[byte] = sign * (1 + man / 2**mbits) * 2.0 ** (exp - bias)
    return values


def encode(values_f32: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating RN-even cast of fp32 values to FP8 bytes (NaN -> 0x7F | sign)."""
    table = decode_table(fmt)
    fmax = FMT[fmt][3]
    positive = np.array([table[b] for b in range(128) if np.isfinite(table[b])])
    out = np.zeros(values_f32.shape, dtype=np.uint8)
    for index, value in np.ndenumerate(values_f32.astype(np.float64)):
        sign_bit = 0x80 if math.copysign(1.0, value) < 0 else 0
        if math.isnan(value):
            out[index] = 0x7F | sign_bit
            continue
        magnitude = min(abs(value), fmax)
        hi = int(np.searchsorted(positive, magnitude))
        if positive[hi] == magnitude:
            code = hi
        else:
            lo = hi - 1
            below, above = magnitude - positive[lo], positive[hi] - magnitude
            code = lo if below < above else hi if above < below else (lo if lo % 2 == 0 else hi)
        out[index] = code | sign_bit
    return out


def bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def from_bits(pattern: int) -> np.float32:
    return np.frombuffer(struct.pack("<I", pattern), dtype=np.float32)[0]


def nan_free_amax(block: np.ndarray) -> np.float32:
    magnitude = np.abs(block.astype(np.float32))
    magnitude[np.isnan(magnitude)] = 0
    return F32(magnitude.max()) if magnitude.size else F32(0)


def current_scale(amax: np.float32, fmt: str, pow2: bool, inf_value: float) -> np.float32:
    """fp8_max / amax with the docs/FP8_NUMERICS.md guards, all in fp32."""
    if amax == 0 or not np.isfinite(amax):
        scale = F32(1.0)
    else:
        with np.errstate(over="ignore", divide="ignore"):
            scale = F32(FMT[fmt][3]) / amax
        if np.isinf(scale):
            scale = F32(inf_value)
    if pow2:
        scale = from_bits(bits(scale) & 0xFF800000)
    return scale


def e8m0(t: np.float32) -> int:
    if np.isnan(t):
        return 255
    if np.isinf(t):
        return 254
    if t == 0:
        return 0
    pattern = bits(float(t))
    exponent, mantissa = (pattern >> 23) & 0xFF, pattern & 0x7FFFFF
    if mantissa > 0 and exponent != 254 and not (exponent == 0 and mantissa <= 0x400000):
        return exponent + 1
    return exponent


def quantize_block(block: np.ndarray, fmt: str, recipe: str, pow2: bool, inf_value: float):
    """(bytes, stored scale_inv or E8M0 byte) of one block (any shape) under a block recipe."""
    amax = nan_free_amax(block)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if recipe == "mxfp8":
            t = amax * (F32(1.0) / F32(FMT[fmt][3]))
            e = e8m0(t)
            multiplier = F32(math.ldexp(1.0, 127 - e))
            return encode(block.astype(np.float32) * multiplier, fmt), e
        scale = current_scale(amax, fmt, pow2, inf_value)
        return encode(block.astype(np.float32) * scale, fmt), F32(1.0) / scale


def quantize_blocks(
    x: np.ndarray,
    fmt: str,
    recipe: str,
    *,
    block_rows: int,
    block_cols: int,
    pow2: bool = True,
    inf_value: float = 3.4028234663852886e38,
):
    """Bytes (x's shape) and scale grid for blocks of block_rows x block_cols over 2-D x."""
    rows, cols = x.shape
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    data = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros(grid, dtype=np.uint8 if recipe == "mxfp8" else np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rs = slice(i * block_rows, (i + 1) * block_rows)
            cs = slice(j * block_cols, (j + 1) * block_cols)
            data[rs, cs], scales[i, j] = quantize_block(x[rs, cs], fmt, recipe, pow2, inf_value)
    return data, scales
