"""Blockwise (1x128, 128x1, 128x128) Triton kernels. Rules and choices: `triton_common.py`."""

from __future__ import annotations

import triton
import triton.language as tl

from megatron.core.fp8.cuda.triton_common import (
    _amax_all,
    _amax_along,
    _byte_words,
    _reciprocal,
    _record_amax,
    _saturating_cast,
    _saturating_cast_t,
    _scale_from_amax,
)


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
