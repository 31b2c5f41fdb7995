"""Fused Triton quantization kernels (amax + scale + saturating cast + copies in one read).

Imported lazily by `quantize.py` only when Triton is present. Bitwise rules:
docs/FP8_NUMERICS.md; the plain-torch twin is `torch_quantize.py`.

Choices that keep the kernels bitwise equal to PyTorch at few instructions per element (the
kernels are bound by instruction issue as much as by DRAM: every instruction per element
costs bandwidth; `dev/aot_kernels.py` counts them on CPU):
- divisions use `tl.math.div_rn` (IEEE round-to-nearest); Triton's `/` may be approximate;
- the FP8 cast is the hardware's `cvt.rn.satfinite` alone (`.to(fp8)` on sm_89+): it rounds
  to nearest even and saturates overflow and +-Inf to +-max, which is the reference's
  clamp-then-cast; a NaN product becomes byte 0x7F, which is what torch writes for the
  canonical NaN (sign clear) that every GPU multiply by a scale returns;
- max|x| uses the hardware max, which returns the non-NaN operand (maxNum), in the input's
  own dtype (exact; packed bf16x2 on sm_90); only a block that is all NaN reduces to NaN, and
  that reduced value is replaced by 0;
- partial amaxes are combined with an int32 atomic max on the fp32 bit pattern (valid
  because every amax is >= 0, where int order equals float order).

Triton's CPU interpreter differs from the GPU on both hardware behaviours above (and
mis-rounds FP8 casts): check these kernels on a GPU against the reference.
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
def amax_kernel(x_ptr, amax_bits_ptr, numel, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Pass one of tensorwise scaling: NaN-ignoring max|x| of a flat tensor. Each program
    reduces GROUP consecutive blocks in registers, then makes one atomic max. Programs take
    their blocks from the end of the tensor backwards (see amax_partials_kernel)."""
    programs = tl.num_programs(0)
    base = (programs - 1 - tl.program_id(0)).to(tl.int64) * (BLOCK * GROUP)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(GROUP):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    amax = _amax_along(acc, 0)
    _record_amax(amax_bits_ptr, amax)


@triton.jit
def amax_partials_kernel(
    x_ptr,
    partials_ptr,
    numel,
    blocks_per_program,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    """Pass one of tensorwise scaling without atomics: program p writes the NaN-ignoring
    max|x| of its `blocks_per_program` BLOCKs to partials[p] (0 where it has none), so the
    buffer needs no zero fill first; the cast kernel reduces the partials.

    Program p takes blocks p, p + P, p + 2P, ... (P programs, all resident at once) from the
    last such block down, so the tensor is read from its end towards its start: what is
    still in L2 when the cast kernel starts is the tensor's start, which is what the cast
    kernel (tiles in address order) reads first. The running max stays in x's dtype (exact;
    packed bf16x2 on sm_90). EVEN: the programs' blocks cover the tensor exactly, so no load
    needs a mask."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty)
    for i in range(blocks_per_program):
        block = (blocks_per_program - 1 - i) * programs + pid
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(x_ptr + offs)
        else:
            x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
        # Triton computes a bf16 max in fp32; the exact casts around it fold away (SASS:
        # HMNMX2.BF16_V2).
        acc = tl.maximum(acc, tl.abs(x)).to(acc.dtype)
    tl.store(partials_ptr + pid, _amax_along(acc, 0))


@triton.jit
def per_tensor_cast_kernel(
    x_ptr,
    data_ptr,
    data_t_ptr,
    scale_ptr,
    amax_ptr,
    scale_inv_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    SCALE_GIVEN: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    WRITE_ROW: tl.constexpr,
    WRITE_T: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    TRANS_X: tl.constexpr,
    AMAX_PARTIALS: tl.constexpr = 0,
):
    """Delayed (SCALE_GIVEN; RECORD_AMAX atomically maxes max|x| into amax_bits_ptr, which may
    be slot 0 of an amax history) or tensorwise (scale from the finished amax) cast; the
    rowwise bytes and/or their transpose are written from the same read.

    Each program walks GROUP BM x BK tiles down one column strip and loads the next tile
    before it stores the current one, so a load is always in flight (a store may alias a
    later load as far as the compiler knows, so it would not hoist the load itself); the amax
    is reduced in registers across the strip, one atomic per program. TRANS_X transposes
    the high-precision tile and casts it again instead of transposing the FP8 bytes (same
    bytes, a different shared-memory exchange; the sweep picks). AMAX_PARTIALS > 0: amax_ptr
    holds that many partial maxima (amax_partials_kernel), reduced here; 0: the finished
    max|x|."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BK)
    pid_k = pid % k_tiles
    if SCALE_GIVEN:
        scale = tl.load(scale_ptr)
    elif AMAX_PARTIALS > 0:
        partials = tl.load(amax_ptr + tl.arange(0, AMAX_PARTIALS))
        scale = _scale_from_amax(tl.max(partials, axis=0), FP8_MAX, INF_SCALE, POW2)
    else:
        # A given max|x| (fp32, or x's dtype from linear_ops.producer_amax): exact in fp32.
        amax = tl.load(amax_ptr).to(tl.float32)
        scale = _scale_from_amax(amax, FP8_MAX, INF_SCALE, POW2)
    cols = pid_k * BK + tl.arange(0, BK)
    rows = (pid // k_tiles) * (GROUP * BM) + tl.arange(0, BM)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x_raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # Per-row running max: a full [BM, BK] accumulator held 168 registers per thread on sm_90
    # (18.75% occupancy, 47% of DRAM bandwidth under ncu) for the delayed row + T cast.
    running_max = tl.zeros((BM,), dtype=tl.float32)
    for i in range(GROUP):
        next_rows = rows + BM
        next_mask = (next_rows[:, None] < M) & (cols[None, :] < K) & (i + 1 < GROUP)
        # Not offs + BM * K: K is an int32 argument, so BM * K would wrap past 2^31 elements.
        next_offs = next_rows.to(tl.int64)[:, None] * K + cols[None, :]
        next_raw = tl.load(x_ptr + next_offs, mask=next_mask, other=0.0)
        x = x_raw.to(tl.float32)
        if WRITE_ROW:
            tl.store(data_ptr + offs, _saturating_cast(x * scale, E4M3), mask=mask)
        if WRITE_T:
            if TRANS_X:
                q_t = _saturating_cast_t(tl.trans(x_raw).to(tl.float32) * scale, E4M3)
            else:
                q_t = tl.trans(_saturating_cast_t(x * scale, E4M3))
            offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
            mask_t = (cols[:, None] < K) & (rows[None, :] < M)
            tl.store(data_t_ptr + offs_t, q_t, mask=mask_t)
        if RECORD_AMAX:
            running_max = tl.maximum(running_max, _amax_along(x_raw, 1))
        x_raw, rows, mask, offs = next_raw, next_rows, next_mask, next_offs
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, tl.max(running_max, axis=0))
    if pid == 0:
        tl.store(scale_inv_ptr, _reciprocal(scale, POW2))


@triton.jit
def _tile_at(x_ptr, M, K, pid_m, cols, TILE: tl.constexpr):
    """Tile row pid_m of a column strip: raw values (zero padded), rows, mask, offsets."""
    rows = pid_m * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    return tl.load(x_ptr + offs, mask=mask, other=0.0), rows, mask, offs


@triton.jit
def block_1x128_rows_kernel(
    x_ptr,
    row_ptr,
    row_sinv_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    ROW_SCALE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
    BM: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Rowwise 1x128 copy: BM x 128 tiles (each row of a tile is one block), GROUP tiles down
    one column strip per program. ROW_SCALE_T stores the scales as [ceil(K/128), M], the
    outer-dim-major layout cuBLAS reads, instead of the logical [M, ceil(K/128)].

    Used for the rowwise copy alone, and with block_128x1_cols_kernel for both copies where
    no one-launch kernel applies (block_1x128_pair_kernel and block_1x128_fused_kernel: see
    quantize.block_1x128_fused_spec)."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, TILE)
    pid_k = pid % k_tiles
    cols = pid_k * TILE + tl.arange(0, TILE)
    strip_max = tl.zeros((BM,), dtype=tl.float32)
    for i in range(GROUP):
        rows = ((pid // k_tiles) * GROUP + i) * BM + tl.arange(0, BM)
        row_amax = _rows_tile(
            x_ptr,
            row_ptr,
            row_sinv_ptr,
            rows,
            cols,
            pid_k,
            k_tiles,
            M,
            K,
            FP8_MAX,
            E4M3,
            INF_SCALE,
            POW2,
            ROW_SCALE_T,
        )
        if RECORD_AMAX:
            strip_max = tl.maximum(strip_max, row_amax)
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, tl.max(strip_max, axis=0))


@triton.jit
def _rows_tile(
    x_ptr,
    row_ptr,
    row_sinv_ptr,
    rows,
    cols,
    pid_k,
    k_tiles,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    ROW_SCALE_T: tl.constexpr,
):
    """The 1x128 rowwise bytes and scales of one (rows x 128 cols) tile; returns the rows'
    amaxes."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x_raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
    row_amax = _amax_along(x_raw, 1)
    scale = _scale_from_amax(row_amax, FP8_MAX, INF_SCALE, POW2)
    q = _saturating_cast(x_raw.to(tl.float32) * scale[:, None], E4M3)
    tl.store(row_ptr + offs, q, mask=mask)
    if ROW_SCALE_T:
        sinv_offs = pid_k.to(tl.int64) * M + rows
    else:
        sinv_offs = rows.to(tl.int64) * k_tiles + pid_k
    tl.store(row_sinv_ptr + sinv_offs, _reciprocal(scale, POW2), mask=rows < M)
    return row_amax


@triton.jit
def block_128x1_cols_kernel(
    x_ptr,
    col_ptr,
    col_sinv_ptr,
    col_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    WRITE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
    BK: tl.constexpr,
    TRANS_X: tl.constexpr,
):
    """Columnwise 128x1 copy of a 128 x BK tile (each column of it is one block), scales
    [ceil(M/128), K]. COLUMNWISE writes the bytes in x's shape, WRITE_T their [K, M]
    transpose (the wgrad operand); TRANS_X casts the transposed high-precision tile instead of
    transposing the bytes."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BK)
    pid_m = pid // k_tiles
    cols = (pid % k_tiles) * BK + tl.arange(0, BK)
    col_amax = _cols_tile(
        x_ptr,
        col_ptr,
        col_sinv_ptr,
        col_t_ptr,
        pid_m,
        cols,
        M,
        K,
        FP8_MAX,
        E4M3,
        INF_SCALE,
        POW2,
        COLUMNWISE,
        WRITE_T,
        TILE,
        TRANS_X,
    )
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, tl.max(col_amax, axis=0))


@triton.jit
def _cols_tile(
    x_ptr,
    col_ptr,
    col_sinv_ptr,
    col_t_ptr,
    pid_m,
    cols,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    WRITE_T: tl.constexpr,
    TILE: tl.constexpr,
    TRANS_X: tl.constexpr,
):
    """The 128x1 columnwise bytes (x's shape and/or transposed) and scales of one (128 rows x
    cols) tile; returns the columns' amaxes."""
    rows = pid_m * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x_raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    col_amax = _amax_along(x_raw, 0)
    scale = _scale_from_amax(col_amax, FP8_MAX, INF_SCALE, POW2)
    tl.store(col_sinv_ptr + pid_m.to(tl.int64) * K + cols, _reciprocal(scale, POW2), mask=cols < K)
    if COLUMNWISE:
        tl.store(col_ptr + offs, _saturating_cast(x * scale[None, :], E4M3), mask=mask)
    if WRITE_T:
        if TRANS_X:
            q_t = _saturating_cast_t(tl.trans(x_raw).to(tl.float32) * scale[:, None], E4M3)
        else:
            q_t = tl.trans(_saturating_cast_t(x * scale[None, :], E4M3))
        offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(col_t_ptr + offs_t, q_t, mask=mask_t)
    return col_amax


@triton.jit
def block_1x128_pair_kernel(
    x_ptr,
    row_ptr,
    row_sinv_ptr,
    col_ptr,
    col_sinv_ptr,
    col_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    ROW_SCALE_T: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    WRITE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    TRANS_X: tl.constexpr,
):
    """Both 1x128 copies in one launch, each program doing one kernel's work: every 128x128
    tile of x gets TILE // BM programs of block_1x128_rows_kernel's tiles and TILE // BK of
    block_128x1_cols_kernel's, with consecutive ids. The GPU starts consecutive programs
    together, so the tile is read from DRAM about once between them and the other reads hit
    L2; each program keeps its single-copy kernel's registers and occupancy (arguments as
    block_1x128_fused_kernel's)."""
    tl.static_assert((TILE % BM == 0) and (TILE % BK == 0), "BM and BK must divide 128")
    ROW_PARTS: tl.constexpr = TILE // BM
    PARTS: tl.constexpr = ROW_PARTS + TILE // BK
    pid = tl.program_id(0)
    tile = pid // PARTS
    part = pid % PARTS
    k_tiles = tl.cdiv(K, TILE)
    pid_m = tile // k_tiles
    pid_k = tile % k_tiles
    # (Triton needs a name bound in both branches to have one type: each branch has its own.)
    if part < ROW_PARTS:
        tile_rows = pid_m * TILE + part * BM + tl.arange(0, BM)
        tile_cols = pid_k * TILE + tl.arange(0, TILE)
        row_amax = _rows_tile(
            x_ptr,
            row_ptr,
            row_sinv_ptr,
            tile_rows,
            tile_cols,
            pid_k,
            k_tiles,
            M,
            K,
            FP8_MAX,
            E4M3,
            INF_SCALE,
            POW2,
            ROW_SCALE_T,
        )
        if RECORD_AMAX:
            _record_amax(amax_bits_ptr, tl.max(row_amax, axis=0))
    else:
        strip_cols = pid_k * TILE + (part - ROW_PARTS) * BK + tl.arange(0, BK)
        col_amax = _cols_tile(
            x_ptr,
            col_ptr,
            col_sinv_ptr,
            col_t_ptr,
            pid_m,
            strip_cols,
            M,
            K,
            FP8_MAX,
            E4M3,
            INF_SCALE,
            POW2,
            COLUMNWISE,
            WRITE_T,
            TILE,
            TRANS_X,
        )
        if RECORD_AMAX:
            _record_amax(amax_bits_ptr, tl.max(col_amax, axis=0))


@triton.jit
def block_1x128_fused_kernel(
    x_ptr,
    row_ptr,
    row_sinv_ptr,
    col_ptr,
    col_sinv_ptr,
    col_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    ROW_SCALE_T: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    WRITE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
):
    """Both 1x128 copies from one read of a 128x128 tile, for M % 4 == 0: the rowwise bytes
    with one scale per row (ROW_SCALE_T as in block_1x128_rows_kernel) and the 128x1
    columnwise bytes with one scale per column, in x's shape (COLUMNWISE) and/or transposed
    (WRITE_T). Reads x from DRAM once where the two single-copy kernels read it twice.

    The tile is read as four 32 x 128 tiles of rows 4q + j (j = 0..3), which Triton lays out
    alike, so each thread holds the four bytes of rows 4q..4q+3 of a column: one
    little-endian int32 of the [K, M] transpose, and only those words (a quarter of the
    elements) go through shared memory for the transposed store. Its two passes hold 129
    registers per thread (3 blocks per SM), so the transposed copy goes through
    block_1x128_pair_kernel instead (81.8% of copy against 64.9% on the H200); this kernel
    keeps the API's columnwise copy in x's shape, where it is the faster one."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, TILE)
    pid_m = pid // k_tiles
    pid_k = pid % k_tiles
    cols = pid_k * TILE + tl.arange(0, TILE)
    quads = pid_m * (TILE // 4) + tl.arange(0, TILE // 4)
    mask = (quads[:, None] * 4 < M) & (cols[None, :] < K)
    offs = (quads * 4).to(tl.int64)[:, None] * K + cols[None, :]
    # Pass 1: the amaxes only (each x_j dies once reduced, which keeps registers low).
    quad_max = tl.zeros((TILE // 4, TILE), dtype=tl.float32)
    for j in tl.static_range(4):
        x_j = tl.load(x_ptr + offs + j * K, mask=mask, other=0.0)
        quad_max = tl.maximum(quad_max, tl.abs(x_j.to(tl.float32)))
    col_max = _amax_along(quad_max, 0)
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, tl.max(col_max, axis=0))
    col_scale = _scale_from_amax(col_max, FP8_MAX, INF_SCALE, POW2)
    col_sinv_offs = pid_m.to(tl.int64) * K + cols
    tl.store(col_sinv_ptr + col_sinv_offs, _reciprocal(col_scale, POW2), mask=cols < K)
    # Pass 2: the tile again, from L2 (DRAM reads it once): both casts, four rows at a time,
    # the transposed words built up byte by byte. The store above keeps the compiler from
    # merging these loads with pass 1's.
    words = tl.zeros((TILE // 4, TILE), dtype=tl.int32)
    for j in tl.static_range(4):
        x_j = tl.load(x_ptr + offs + j * K, mask=mask, other=0.0)
        _fused_rows(
            x_j,
            row_ptr,
            row_sinv_ptr,
            offs + j * K,
            mask,
            quads * 4 + j,
            pid_k,
            k_tiles,
            M,
            FP8_MAX,
            E4M3,
            INF_SCALE,
            POW2,
            ROW_SCALE_T,
        )
        b_j = _byte_words(x_j.to(tl.float32) * col_scale[None, :], E4M3)
        if COLUMNWISE:
            tl.store(col_ptr + offs + j * K, b_j.to(tl.uint8), mask=mask)
        words = words | (b_j << (8 * j))
    if WRITE_T:
        words_t_ptr = col_t_ptr.to(tl.pointer_type(tl.int32))
        offs_t = cols.to(tl.int64)[:, None] * (M // 4) + quads[None, :]
        mask_t = (cols[:, None] < K) & (quads[None, :] * 4 < M)
        tl.store(words_t_ptr + offs_t, tl.trans(words), mask=mask_t)


@triton.jit
def _fused_rows(
    x_raw,
    row_ptr,
    row_sinv_ptr,
    offs,
    mask,
    rows,
    pid_k,
    k_tiles,
    M,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    ROW_SCALE_T: tl.constexpr,
):
    """block_1x128_fused_kernel's rowwise bytes and scales of the rows in one x_j."""
    row_scale = _scale_from_amax(_amax_along(x_raw, 1), FP8_MAX, INF_SCALE, POW2)
    q = _saturating_cast(x_raw.to(tl.float32) * row_scale[:, None], E4M3)
    tl.store(row_ptr + offs, q, mask=mask)
    if ROW_SCALE_T:
        sinv_offs = pid_k.to(tl.int64) * M + rows
    else:
        sinv_offs = rows.to(tl.int64) * k_tiles + pid_k
    tl.store(row_sinv_ptr + sinv_offs, _reciprocal(row_scale, POW2), mask=rows < M)


@triton.jit
def block_128x128_kernel(
    x_ptr,
    data_ptr,
    sinv_ptr,
    data_t_ptr,
    sinv_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    INF_SCALE: tl.constexpr,
    POW2: tl.constexpr,
    WRITE_ROW: tl.constexpr,
    WRITE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
    TRANS_X: tl.constexpr,
):
    """One 128x128 weight block: one scale; the bytes and/or the transposed bytes with the
    transposed scale grid (what dgrad reads), from one read of the whole tile. TRANS_X casts
    the transposed high-precision tile again; without it the bytes are cast once and
    transposed (the same bytes: one scale for the whole block; half the FP8 conversions)."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, TILE)
    pid_m = pid // k_tiles
    pid_k = pid % k_tiles
    cols = pid_k * TILE + tl.arange(0, TILE)
    x_raw, rows, mask, offs = _tile_at(x_ptr, M, K, pid_m, cols, TILE)
    x = x_raw.to(tl.float32)
    tile_amax = _amax_all(x_raw)
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, tile_amax)
    scale = _scale_from_amax(tile_amax, FP8_MAX, INF_SCALE, POW2)
    scale_inv = _reciprocal(scale, POW2)
    tl.store(sinv_ptr + pid_m * k_tiles + pid_k, scale_inv)
    if WRITE_T and not TRANS_X:
        q = _saturating_cast_t(x * scale, E4M3)
    elif WRITE_ROW:
        q = _saturating_cast(x * scale, E4M3)
    if WRITE_ROW:
        tl.store(data_ptr + offs, q, mask=mask)
    if WRITE_T:
        tl.store(sinv_t_ptr + pid_k * tl.cdiv(M, TILE) + pid_m, scale_inv)
        if TRANS_X:
            q_t = _saturating_cast_t(tl.trans(x_raw).to(tl.float32) * scale, E4M3)
        else:
            q_t = tl.trans(q)
        offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(data_t_ptr + offs_t, q_t, mask=mask_t)


@triton.jit
def mxfp8_kernel(
    x_ptr,
    row_ptr,
    row_e_ptr,
    col_ptr,
    col_e_ptr,
    col_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    RCP_FP8_MAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    WRITE_T: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    DEQUANT: tl.constexpr,
    CHUNKS: tl.constexpr,
    E_WORDS: tl.constexpr,
):
    """1x32 rowwise and 32x1 columnwise MX copies from a single read.

    A program takes one 32-row strip and CHUNKS 32x32 chunks along it: a chunk is exactly one
    MX block per row and one per column, so both amaxes are plain reductions of the chunk
    (no reshapes, whose layout conversions held an earlier 32x128-tile version to 22-40% of
    copy bandwidth). E8M0 scales go to row_e [M, ceil(K/32)] and col_e [ceil(M/32), K];
    WRITE_T also writes the columnwise bytes' [K, M] transpose. DEQUANT (the emulated MXFP8
    GEMM on sm_90) writes, instead of bytes and scales, the dequantized values
    q * 2^(e - 127) in row_ptr / col_ptr's dtype: exactly dequantize(quantize(x)), without
    the FP8 bytes ever reaching memory. E_WORDS (CHUNKS 2 or 4, K a multiple of 32 * CHUNKS)
    stores each row's CHUNKS rowwise E8M0 bytes as one little-endian int16 / int32, as
    mxfp8_quads_kernel does."""
    pid = tl.program_id(0)
    k_groups = tl.cdiv(K, 32 * CHUNKS)
    k_blocks = tl.cdiv(K, 32)
    pid_m = pid // k_groups
    rows = pid_m * 32 + tl.arange(0, 32)
    strip_max = tl.max(tl.zeros((32,), dtype=tl.float32), axis=0)
    if E_WORDS:
        tl.static_assert((CHUNKS == 2) or (CHUNKS == 4), "E_WORDS packs 2 or 4 E8M0 bytes")
        tl.static_assert(not DEQUANT, "dequantized values have no E8M0 bytes")
    row_words = tl.zeros((32,), dtype=tl.int32)
    for c in tl.static_range(CHUNKS):
        block = (pid % k_groups) * CHUNKS + c
        cols = block * 32 + tl.arange(0, 32)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        x_raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        if ROWWISE or RECORD_AMAX:
            row_amax = _amax_along(x_raw, 1)
        if RECORD_AMAX:
            strip_max = tl.maximum(strip_max, tl.max(row_amax, axis=0))
        if ROWWISE:
            e = _e8m0_from_amax(row_amax, RCP_FP8_MAX)
            q = _saturating_cast(x * _e8m0_multiplier(e)[:, None], E4M3)
            if DEQUANT:
                deq = _dequantized(q, _e8m0_dequant_multiplier(e)[:, None], E4M3)
                tl.store(row_ptr + offs, deq.to(row_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(row_ptr + offs, q, mask=mask)
                if E_WORDS:
                    row_words = row_words | (e << (8 * c))
                else:
                    e_offs = rows.to(tl.int64) * k_blocks + block
                    tl.store(
                        row_e_ptr + e_offs, e.to(tl.uint8), mask=(rows < M) & (block < k_blocks)
                    )
        if COLUMNWISE or WRITE_T:
            e = _e8m0_from_amax(_amax_along(x_raw, 0), RCP_FP8_MAX)
            if WRITE_T:
                q = _saturating_cast_t(x * _e8m0_multiplier(e)[None, :], E4M3)
            else:
                q = _saturating_cast(x * _e8m0_multiplier(e)[None, :], E4M3)
            if DEQUANT:
                deq = _dequantized(q, _e8m0_dequant_multiplier(e)[None, :], E4M3)
                tl.store(col_ptr + offs, deq.to(col_ptr.dtype.element_ty), mask=mask)
            else:
                if COLUMNWISE:
                    tl.store(col_ptr + offs, q, mask=mask)
                e_offs = pid_m.to(tl.int64) * K + cols
                tl.store(col_e_ptr + e_offs, e.to(tl.uint8), mask=(cols < K) & (pid_m * 32 < M))
                if WRITE_T:
                    offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
                    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
                    tl.store(col_t_ptr + offs_t, tl.trans(q), mask=mask_t)
    if ROWWISE and E_WORDS and not DEQUANT:
        # Word pid % k_groups of each row of row_e viewed as [M, K / (32 * CHUNKS)] words.
        if CHUNKS == 2:
            words_ptr = row_e_ptr.to(tl.pointer_type(tl.int16))
            words = row_words.to(tl.int16)
        else:
            words_ptr = row_e_ptr.to(tl.pointer_type(tl.int32))
            words = row_words
        word_offs = rows.to(tl.int64) * k_groups + pid % k_groups
        tl.store(words_ptr + word_offs, words, mask=rows < M)
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, strip_max)


@triton.jit
def mxfp8_quads_kernel(
    x_ptr,
    row_ptr,
    row_e_ptr,
    col_ptr,
    col_e_ptr,
    col_t_ptr,
    amax_bits_ptr,
    M,
    K,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    RCP_FP8_MAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    DEQUANT: tl.constexpr,
    CHUNKS: tl.constexpr,
    E_WORDS: tl.constexpr,
):
    """mxfp8_kernel without the transposed copy (col_t_ptr is unused: the arguments are
    mxfp8_kernel's), each 32x32 chunk read as four 8 x 32 tiles of rows 4q + j: a thread
    then holds four rows of each of its columns, so a column's amax is mostly an in-thread
    max and needs three shuffle rounds where the 32-row tile of mxfp8_kernel needed four or
    five (shuffles were a quarter of its instructions).

    E_WORDS (CHUNKS == 4 and K % 128 == 0) stores each row's four rowwise E8M0 bytes of the
    program as one little-endian int32: a one-byte store per row and chunk wrote a sector
    per 32 elements, as many L2 writes as the rowwise bytes themselves, and held the rowwise
    copy to 58% of copy bandwidth against the columnwise copy's 76%."""
    pid = tl.program_id(0)
    k_groups = tl.cdiv(K, 32 * CHUNKS)
    k_blocks = tl.cdiv(K, 32)
    pid_m = pid // k_groups
    quads = pid_m * 8 + tl.arange(0, 8)
    strip_max = tl.max(tl.zeros((8,), dtype=tl.float32), axis=0)
    if E_WORDS:
        tl.static_assert(CHUNKS == 4, "E_WORDS packs the E8M0 bytes of four chunks")
        tl.static_assert(not DEQUANT, "dequantized values have no E8M0 bytes")
    words0 = tl.zeros((8,), dtype=tl.int32)
    words1 = tl.zeros((8,), dtype=tl.int32)
    words2 = tl.zeros((8,), dtype=tl.int32)
    words3 = tl.zeros((8,), dtype=tl.int32)
    STORE_E: tl.constexpr = not (DEQUANT or E_WORDS)
    for c in tl.static_range(CHUNKS):
        block = (pid % k_groups) * CHUNKS + c
        cols = block * 32 + tl.arange(0, 32)
        x0, r0, m0, o0 = _quad_rows(x_ptr, quads, 0, cols, M, K)
        x1, r1, m1, o1 = _quad_rows(x_ptr, quads, 1, cols, M, K)
        x2, r2, m2, o2 = _quad_rows(x_ptr, quads, 2, cols, M, K)
        x3, r3, m3, o3 = _quad_rows(x_ptr, quads, 3, cols, M, K)
        quad_max = tl.maximum(
            tl.maximum(tl.abs(x0.to(tl.float32)), tl.abs(x1.to(tl.float32))),
            tl.maximum(tl.abs(x2.to(tl.float32)), tl.abs(x3.to(tl.float32))),
        )
        col_amax = _amax_along(quad_max, 0)
        if RECORD_AMAX:
            strip_max = tl.maximum(strip_max, tl.max(col_amax, axis=0))
        if ROWWISE:
            e0 = _mx_rows(
                x0,
                r0,
                m0,
                o0,
                block,
                k_blocks,
                row_ptr,
                row_e_ptr,
                M,
                E4M3,
                RCP_FP8_MAX,
                DEQUANT,
                STORE_E,
            )
            e1 = _mx_rows(
                x1,
                r1,
                m1,
                o1,
                block,
                k_blocks,
                row_ptr,
                row_e_ptr,
                M,
                E4M3,
                RCP_FP8_MAX,
                DEQUANT,
                STORE_E,
            )
            e2 = _mx_rows(
                x2,
                r2,
                m2,
                o2,
                block,
                k_blocks,
                row_ptr,
                row_e_ptr,
                M,
                E4M3,
                RCP_FP8_MAX,
                DEQUANT,
                STORE_E,
            )
            e3 = _mx_rows(
                x3,
                r3,
                m3,
                o3,
                block,
                k_blocks,
                row_ptr,
                row_e_ptr,
                M,
                E4M3,
                RCP_FP8_MAX,
                DEQUANT,
                STORE_E,
            )
            if E_WORDS:
                words0 = words0 | (e0 << (8 * c))
                words1 = words1 | (e1 << (8 * c))
                words2 = words2 | (e2 << (8 * c))
                words3 = words3 | (e3 << (8 * c))
        if COLUMNWISE:
            e = _e8m0_from_amax(col_amax, RCP_FP8_MAX)
            multiplier = _e8m0_multiplier(e)[None, :]
            _mx_cols(x0, m0, o0, multiplier, e, col_ptr, E4M3, DEQUANT)
            _mx_cols(x1, m1, o1, multiplier, e, col_ptr, E4M3, DEQUANT)
            _mx_cols(x2, m2, o2, multiplier, e, col_ptr, E4M3, DEQUANT)
            _mx_cols(x3, m3, o3, multiplier, e, col_ptr, E4M3, DEQUANT)
            if not DEQUANT:
                e_offs = pid_m.to(tl.int64) * K + cols
                tl.store(col_e_ptr + e_offs, e.to(tl.uint8), mask=(cols < K) & (pid_m * 32 < M))
    if ROWWISE and E_WORDS:
        # Word pid % k_groups of each row of row_e viewed as int32 [M, K / 128].
        words_ptr = row_e_ptr.to(tl.pointer_type(tl.int32))
        word = pid % k_groups
        _mx_row_words(words_ptr, words0, quads * 4 + 0, word, k_groups, M)
        _mx_row_words(words_ptr, words1, quads * 4 + 1, word, k_groups, M)
        _mx_row_words(words_ptr, words2, quads * 4 + 2, word, k_groups, M)
        _mx_row_words(words_ptr, words3, quads * 4 + 3, word, k_groups, M)
    if RECORD_AMAX:
        _record_amax(amax_bits_ptr, strip_max)


@triton.jit
def _mx_row_words(words_ptr, words, rows, word, words_per_row, M):
    """Store one int32 of packed E8M0 bytes per row (mxfp8_quads_kernel's E_WORDS)."""
    tl.store(words_ptr + rows.to(tl.int64) * words_per_row + word, words, mask=rows < M)


@triton.jit
def _quad_rows(x_ptr, quads, j: tl.constexpr, cols, M, K):
    """Rows 4q + j (q in quads) of x at cols: values (zero padded), rows, mask, offsets."""
    rows = quads * 4 + j
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    return tl.load(x_ptr + offs, mask=mask, other=0.0), rows, mask, offs


@triton.jit
def _mx_rows(
    x_raw,
    rows,
    mask,
    offs,
    block,
    k_blocks,
    row_ptr,
    row_e_ptr,
    M,
    E4M3: tl.constexpr,
    RCP_FP8_MAX: tl.constexpr,
    DEQUANT: tl.constexpr,
    STORE_E: tl.constexpr,
):
    """mxfp8_quads_kernel's rowwise copy of one 8 x 32 tile (one MX block per row); returns
    the rows' E8M0 bytes (as int32), stored here when STORE_E."""
    e = _e8m0_from_amax(_amax_along(x_raw, 1), RCP_FP8_MAX)
    q = _saturating_cast(x_raw.to(tl.float32) * _e8m0_multiplier(e)[:, None], E4M3)
    if DEQUANT:
        deq = _dequantized(q, _e8m0_dequant_multiplier(e)[:, None], E4M3)
        tl.store(row_ptr + offs, deq.to(row_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(row_ptr + offs, q, mask=mask)
    if STORE_E:
        e_offs = rows.to(tl.int64) * k_blocks + block
        tl.store(row_e_ptr + e_offs, e.to(tl.uint8), mask=(rows < M) & (block < k_blocks))
    return e


@triton.jit
def _mx_cols(x_raw, mask, offs, multiplier, e, col_ptr, E4M3: tl.constexpr, DEQUANT: tl.constexpr):
    """mxfp8_quads_kernel's columnwise copy (x's shape) of one 8 x 32 tile."""
    q = _saturating_cast(x_raw.to(tl.float32) * multiplier, E4M3)
    if DEQUANT:
        deq = _dequantized(q, _e8m0_dequant_multiplier(e)[None, :], E4M3)
        tl.store(col_ptr + offs, deq.to(col_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(col_ptr + offs, q, mask=mask)


@triton.jit
def mxfp8_dequantize_kernel(
    data_ptr,
    e_ptr,
    out_ptr,
    M,
    K,
    E4M3: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """MXFP8 bytes [M, K] + E8M0 scales (1x32 rowwise [M, K/32] or 32x1 columnwise
    [M/32, K]) -> q * 2^(e - 127) in out_ptr's dtype (byte 0 means 2^-127, 255 NaN). One
    32-row strip and CHUNKS 32x32 chunks per program: each chunk needs one scale per row
    (rowwise) or per column (columnwise), loaded as a vector, not gathered per element."""
    pid = tl.program_id(0)
    k_groups = tl.cdiv(K, 32 * CHUNKS)
    pid_m = pid // k_groups
    rows = pid_m * 32 + tl.arange(0, 32)
    for c in tl.static_range(CHUNKS):
        block = (pid % k_groups) * CHUNKS + c
        cols = block * 32 + tl.arange(0, 32)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        q_bytes = tl.load(data_ptr + offs, mask=mask, other=0)
        if COLUMNWISE:
            e = tl.load(e_ptr + pid_m.to(tl.int64) * K + cols, mask=cols < K, other=127)
            multiplier = _e8m0_dequant_multiplier(e.to(tl.int32))[None, :]
        else:
            e_offs = rows.to(tl.int64) * tl.cdiv(K, 32) + block
            e = tl.load(e_ptr + e_offs, mask=(rows < M) & (block * 32 < K), other=127)
            multiplier = _e8m0_dequant_multiplier(e.to(tl.int32))[:, None]
        deq = _dequantized(q_bytes, multiplier, E4M3)
        tl.store(out_ptr + offs, deq.to(out_ptr.dtype.element_ty), mask=mask)


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


@triton.jit
def delayed_update_kernel(
    hist_ptr,
    scale_ptr,
    new_scale_ptr,
    rolled_ptr,
    L,
    FP8_MAX: tl.constexpr,
    MARGIN_FACTOR: tl.constexpr,
    MOST_RECENT: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Delayed scaling steps 3 and 4 for row `program_id` of a stacked [N, L] amax history:
    new scale from the history, then the rolled history (slot k <- k+1, last <- first, slot
    0 zeroed). Same arithmetic as reference.delayed_scale_update / roll_amax_history."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    history = tl.load(hist_ptr + row * L + offs, mask=offs < L, other=0.0)
    if MOST_RECENT:
        amax_used = tl.load(hist_ptr + row * L)
    else:
        amax_used = tl.max(history, axis=0)
    usable = (amax_used > 0.0) & (amax_used.to(tl.int32, bitcast=True) < 0x7F800000)
    raw = tl.math.div_rn(FP8_MAX + tl.zeros_like(amax_used), tl.where(usable, amax_used, 1.0))
    # Dividing by 2^margin is exact either way (torch multiplies by the exact reciprocal).
    raw = raw * MARGIN_FACTOR
    raw = tl.where(raw.to(tl.int32, bitcast=True) == 0x7F800000, 3.4028234663852886e38, raw)
    tl.store(new_scale_ptr + row, tl.where(usable, raw, tl.load(scale_ptr + row)))
    shifted = tl.load(hist_ptr + row * L + (offs + 1) % L, mask=offs < L, other=0.0)
    tl.store(rolled_ptr + row * L + offs, tl.where(offs == 0, 0.0, shifted), mask=offs < L)


@triton.jit
def _piece_tile(src_ptr, param_start, numel, K, row_base, TR: tl.constexpr, TC: tl.constexpr):
    """Tile `program_id` of a flat piece [param_start, param_start + numel) of a row-major
    [M, K] weight (src_ptr points at the piece's first element). Tiles start at row_base, a
    multiple of TR, so they are aligned with every scale-cell grid; elements outside the
    piece are masked (and read as 0, which never raises an amax)."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(K, TC)
    row0 = row_base + (pid // col_tiles) * TR
    col0 = (pid % col_tiles) * TC
    rows = row0 + tl.arange(0, TR)
    cols = col0 + tl.arange(0, TC)
    local = rows.to(tl.int64)[:, None] * K + cols[None, :] - param_start
    mask = (cols[None, :] < K) & (local >= 0) & (local < numel)
    x = tl.load(src_ptr + local, mask=mask, other=0.0).to(tl.float32)
    return x, rows, cols, local, mask, row0, col0


@triton.jit
def piece_amax_kernel(
    src_ptr,
    amax_bits_ptr,
    param_start,
    numel,
    K,
    row_base,
    grid_rows,
    grid_cols,
    CR: tl.constexpr,
    CC: tl.constexpr,
    RG: tl.constexpr,
    CG: tl.constexpr,
    TR: tl.constexpr,
    TC: tl.constexpr,
):
    """Partial amax of every CR x CC scale cell a weight piece touches: the tile's NaN-ignoring
    |x| is reduced to its RG x CG cells in registers, then one int32 atomic max per cell
    (fp32 bits; valid because amaxes are >= 0) into the flattened [grid_rows, grid_cols] grid.
    A whole-tensor cell is CR = CC = 2^30 (one cell, RG = CG = 1)."""
    x, rows, cols, local, mask, row0, col0 = _piece_tile(
        src_ptr, param_start, numel, K, row_base, TR, TC
    )
    # The hardware max skips NaN; a cell that is all NaN reduces to NaN, which `cells > 0`
    # leaves out like a zero cell.
    cells = tl.reshape(tl.abs(x), (RG, TR // RG, CG, TC // CG))
    cells = tl.max(tl.max(cells, axis=3), axis=1)
    cell_rows = row0 // CR + tl.arange(0, RG)
    cell_cols = col0 // CC + tl.arange(0, CG)
    offs = cell_rows.to(tl.int64)[:, None] * grid_cols + cell_cols[None, :]
    cell_mask = (cell_rows[:, None] < grid_rows) & (cell_cols[None, :] < grid_cols) & (cells > 0)
    tl.atomic_max(
        amax_bits_ptr + offs, cells.to(tl.int32, bitcast=True), mask=cell_mask, sem="relaxed"
    )


@triton.jit
def piece_cast_kernel(
    src_ptr,
    dst_ptr,
    multiplier_ptr,
    param_start,
    numel,
    K,
    row_base,
    grid_cols,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    CR: tl.constexpr,
    CC: tl.constexpr,
    TR: tl.constexpr,
    TC: tl.constexpr,
):
    """FP8 bytes of a weight piece: each element times its cell's quantize multiplier (the
    flattened grid at multiplier_ptr), saturated and rounded; written to dst_ptr (the piece's
    first byte), so a shard's bytes land in place."""
    x, rows, cols, local, mask, row0, col0 = _piece_tile(
        src_ptr, param_start, numel, K, row_base, TR, TC
    )
    cells = (rows // CR).to(tl.int64)[:, None] * grid_cols + (cols // CC)[None, :]
    multiplier = tl.load(multiplier_ptr + cells, mask=mask, other=1.0)
    tl.store(dst_ptr + local, _saturating_cast(x * multiplier, E4M3), mask=mask)
