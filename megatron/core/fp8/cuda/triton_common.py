"""Shared device functions of the fused Triton kernels `triton_{per_tensor,blockwise,mxfp8}.py`
(amax + scale + saturating cast + copies in one read), imported lazily
(`quantize_common.triton_kernels`). Bitwise rules: docs/FP8_NUMERICS.md, `fp8/reference.py`.

The kernels are bound by instruction issue as much as by DRAM (`dev/aot_kernels.py` counts
instructions on CPU), so each rule takes the fewest instructions that stay bitwise equal:
- divisions use `tl.math.div_rn` (IEEE round-to-nearest); Triton's `/` may be approximate;
- the FP8 cast is `cvt.rn.satfinite` alone: RN-even with overflow and +-Inf saturated, the
  reference's clamp-then-cast; a NaN product becomes 0x7F, torch's byte for the canonical NaN;
- max|x| is the hardware max (maxNum: the non-NaN operand) in x's own dtype (exact); only an
  all-NaN block reduces to NaN, replaced by 0;
- partial amaxes meet in an int32 atomic max on the fp32 bits (amax >= 0: int order = float).
Triton's CPU interpreter differs on both hardware behaviours (and mis-rounds FP8 casts):
check these kernels on a GPU against the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _saturating_cast(y, E4M3: tl.constexpr):
    """fp32 -> FP8 bytes (uint8) by cvt.rn.satfinite (see the module docstring)."""
    if E4M3:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


_PAIR_CAST = (
    "{ .reg .b16 pair; .reg .b32 word; cvt.rn.satfinite.%s.f32 pair, $3, $2; "
    "cvt.u32.u16 word, pair; and.b32 $0, word, 255; shr.u32 $1, word, 8; }"
)
_PAIR_CAST_E4M3: tl.constexpr = tl.constexpr(_PAIR_CAST % "e4m3x2")
_PAIR_CAST_E5M2: tl.constexpr = tl.constexpr(_PAIR_CAST % "e5m2x2")


@triton.jit
def _byte_words(y, E4M3: tl.constexpr):
    """_saturating_cast's bytes, each zero-extended in an int32 (see _saturating_cast_t)."""
    if E4M3:
        asm: tl.constexpr = _PAIR_CAST_E4M3
    else:
        asm: tl.constexpr = _PAIR_CAST_E5M2
    return tl.inline_asm_elementwise(asm, "=r,=r,r,r", [y], dtype=tl.int32, is_pure=True, pack=2)


@triton.jit
def _saturating_cast_t(y, E4M3: tl.constexpr):
    """_saturating_cast for a tile that is transposed before it is stored. `.to(fp8)` leaves
    two bytes in each 16-bit register, and such a tile moved through shared memory by
    tl.trans came out wrong on the H200 (Triton 3.6: about a third of the transposed bytes
    differed); the same cvt through inline PTX leaves one zero-extended byte per register."""
    return _byte_words(y, E4M3).to(tl.uint8)


@triton.jit
def _amax_along(x, axis: tl.constexpr):
    """fp32 NaN-ignoring max|x| along `axis` (0 where every element is NaN)."""
    amax = tl.max(tl.abs(x), axis=axis).to(tl.float32)
    return tl.where(amax == amax, amax, 0.0)


@triton.jit
def _amax_all(x):
    """fp32 NaN-ignoring max|x| of a 2-D tile (0 where every element is NaN)."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32)
    return tl.where(amax == amax, amax, 0.0)


@triton.jit
def _record_amax(amax_bits_ptr, amax):
    """Fold a (non-negative, non-NaN) fp32 amax into the int32 cell at amax_bits_ptr: an atomic
    max on the fp32 bit pattern (see the module docstring)."""
    tl.atomic_max(amax_bits_ptr, amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, INF_SCALE: tl.constexpr, POW2: tl.constexpr):
    """fp8_max / amax; amax 0/Inf/NaN -> 1; Inf scale -> INF_SCALE; optional mantissa clear."""
    usable = (amax > 0.0) & (amax.to(tl.int32, bitcast=True) < 0x7F800000)
    if POW2:
        scale = _pow2_scale(amax, FP8_MAX, INF_SCALE)
    else:
        safe_amax = tl.where(usable, amax, 1.0)
        raw = tl.math.div_rn(tl.zeros_like(safe_amax) + FP8_MAX, safe_amax)
        scale = tl.where(raw.to(tl.int32, bitcast=True) == 0x7F800000, INF_SCALE, raw)
    return tl.where(usable, scale, 1.0)


@triton.jit
def _pow2_scale(amax, FP8_MAX: tl.constexpr, INF_SCALE: tl.constexpr):
    """The power-of-two scale (mantissa of RN(FP8_MAX / amax) cleared, INF_SCALE's where
    that is Inf) of a positive finite amax, without the division. FP8_MAX = 1.75 * 2^f, so the
    quotient's exponent is f - e(amax), one less when amax's mantissa exceeds 1.75's
    (0x600000); rounding never carries into the exponent. Subnormal amaxes and exponents past
    254 are the Inf cases. Checked against the division for every positive finite fp32 amax
    and both formats (docs/benchmarks/fp8_quantize_instructions_h200_2026-12-01.md); its
    torch twin is pinned in tests/unit_tests/fp8/test_kernel_integer_rules.py."""
    if FP8_MAX == 448.0:
        f: tl.constexpr = 8
    else:
        tl.static_assert(FP8_MAX == 57344.0, "FP8_MAX is E4M3's or E5M2's")
        f: tl.constexpr = 15
    bits = amax.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    scale_exponent = 254 + f - exponent - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    inf_bits = tl.full((), INF_SCALE, tl.float32).to(tl.int32, bitcast=True) & 0x7F800000
    overflow = (exponent == 0) | (scale_exponent >= 255)
    return tl.where(overflow, inf_bits, scale_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _reciprocal(scale, POW2: tl.constexpr):
    """fp32 1/scale, correctly rounded. A power-of-two scale 2^k (k >= -126, as every scale
    here is) inverts exactly through its exponent bits, which saves the costly div.rn."""
    if POW2:
        exponent = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        bits = tl.where(exponent == 254, 0x00400000, (254 - exponent) << 23)
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _e8m0_from_amax(amax, RCP_FP8_MAX: tl.constexpr):
    """E8M0 byte (as int32) of t = amax * fp32(1/fp8_max), rounded up to a power of two, for
    an amax that is >= 0 and not NaN (what _amax_along returns). The rule of FP8_NUMERICS.md
    in three integer steps: adding 0x7FFFFF to t's bits carries into the exponent exactly when
    the mantissa is nonzero (normal t), adding 0x3FFFFF when it exceeds 0x400000 (subnormal
    t); the +Inf byte 255 and the carry out of 254 both become 254 (torch twin:
    tests/unit_tests/fp8/test_kernel_integer_rules.py)."""
    bits = (amax * RCP_FP8_MAX).to(tl.int32, bitcast=True)
    carry = tl.where(bits < 0x00800000, 0x003FFFFF, 0x007FFFFF)
    return tl.minimum((bits + carry) >> 23, 254)


@triton.jit
def _e8m0_multiplier(e):
    """Exactly 2^(127 - e) from bits, for e in [0, 254]; e = 254 is the fp32 subnormal
    2^-127."""
    bits = tl.where(e == 254, 0x00400000, (254 - e) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_dequant_multiplier(e):
    """Exactly 2^(e - 127); byte 0 is the fp32 subnormal 2^-127, 255 is NaN."""
    bits = tl.where(e == 0, 0x00400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_transposed(out_ptr, q, rows, cols, M, K):
    """Store tile q (rows x cols of [M, K]) into the row-major [K, M] transpose."""
    offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
    tl.store(out_ptr + offs_t, tl.trans(q), mask=mask_t)


@triton.jit
def _dequantized(q_bytes, multiplier, E4M3: tl.constexpr):
    """fp32 value of FP8 bytes times an exact power-of-two (or per-tensor) multiplier."""
    if E4M3:
        q = q_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        q = q_bytes.to(tl.float8e5, bitcast=True).to(tl.float32)
    return q * multiplier


@triton.jit
def transpose_kernel(src_ptr, dst_ptr, M, K, TILE: tl.constexpr):
    """uint8 [M, K] -> [K, M], one TILE x TILE tile per program."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, TILE)
    rows = (pid // k_tiles) * TILE + tl.arange(0, TILE)
    cols = (pid % k_tiles) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    tile = tl.load(src_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask)
    _store_transposed(dst_ptr, tile, rows, cols, M, K)


def grid_size(rows: int, cols: int, tile_rows: int, tile_cols: int) -> tuple[int]:
    """1-D launch grid over row-major tiles (1-D avoids the 65535 limit of grid dims 1, 2)."""
    return (triton.cdiv(rows, tile_rows) * triton.cdiv(cols, tile_cols),)
