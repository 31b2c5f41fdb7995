"""Per-tensor Triton kernels: amax passes, the scale + cast + transpose kernel, the delayed
scaling update and the FSDP piece amax/cast. Rules and choices: `triton_common.py`."""

from __future__ import annotations

import triton
import triton.language as tl

from megatron.core.fp8.cuda.triton_common import (
    _amax_along,
    _reciprocal,
    _record_amax,
    _saturating_cast,
    _saturating_cast_t,
    _scale_from_amax,
)


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
