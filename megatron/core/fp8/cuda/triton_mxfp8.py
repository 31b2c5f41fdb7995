"""MXFP8 (1x32 / 32x1, E8M0 scales) Triton kernels. Rules and choices: `triton_common.py`."""

from __future__ import annotations

import triton
import triton.language as tl

from megatron.core.fp8.cuda.triton_common import (
    _amax_along,
    _dequantized,
    _e8m0_dequant_multiplier,
    _e8m0_from_amax,
    _e8m0_multiplier,
    _record_amax,
    _saturating_cast,
    _saturating_cast_t,
)


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
