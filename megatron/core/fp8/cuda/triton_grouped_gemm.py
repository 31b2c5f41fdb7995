"""Triton kernels of the FP8 grouped GEMMs of the MoE experts (`grouped_gemm.py` launches them).

- `_ragged_m_kernel`: Y[rows of group g] = A[rows of g] @ B[g]^T, A [M, K] FP8 sorted by group,
  B [G, N, K] FP8: the experts' forward (B = the weights) and data gradient (B = the weights'
  transposed copies). One program per (tile of BLOCK_M rows inside one group, tile of N); the
  schedule of row tiles has a static length (the most any group sizes need), the programs
  past the real tiles return at once.
- `_ragged_k_kernel`: C[g] = A[:, cols of g] @ B[:, cols of g]^T with A [N, M] and B [K, M]
  FP8 (the transposed copies of the output gradient and of the input, tokens along M): the
  experts' weight gradient, one [N, K] result per group, reducing over that group's tokens;
  per-tensor scales, or blockwise 128x1 cells along the tokens counted from each group's start
  (scale_inv [N, C] and [K, C], group g's cells from chunk_start[g]). SEGMENTED (per tensor):
  a group is several segments (an expert's rows from several expert-parallel ranks), each
  with its own scales, added up in the kernel.
- `_transpose_bytes_kernel`: the transposed FP8 operands (the weight gradient's padded token
  copies, the data gradient's per-expert weight transposes) as one tiled byte transpose.

Both read K-major FP8 operands (what Hopper's FP8 tensor-core instructions take) and scale the
fp32 accumulator by the operands' scale_inv as the dense GEMM does (docs/FP8_NUMERICS.md):
per-tensor (A a scalar, or in the ragged-M kernel one per row applied to its fp32 sum:
SCALES 0 / 1; B one per group) or blockwise (SCALES 2) (ragged-M: A 1x128 per row and K
block, B 128x128 per group; ragged-K: 1x128 per row of A and of B and 128-token chunk): each
K block's (chunk's) partial product is scaled before it is added, as DeepSeek-V3's blockwise
GEMM does. FAST: one accumulator fed by the tensor cores
(Hopper's FP8 accumulation, cuBLAS's fast accumulation); otherwise each K block's product goes
to a separate fp32 accumulator first (the precise mode the dense gradients use). Results are
bf16 or fp32. A_DTYPE (A's dtype name) only keys the autotuning: a TMA descriptor has no dtype
for the autotuner to tell an E4M3 forward from an E5M2 data gradient by.

Speed (docs/benchmarks/grouped_gemm_fp8stats_h200_2026-12-04b.md): loads are unmasked. The
ragged-M kernel reads whole row tiles (rows past a group are other groups' rows, clamped to the
last row, and dropped at the store) and needs K % BLOCK_K == 0 (EVEN_K) for unmasked K steps.
The ragged-K kernel's MODE: 0 masks every load (~150-190 TFLOP/s: a mask along the contiguous
tokens at an unknown alignment makes byte loads); with whole tiles (every group a multiple of
128 tokens: the experts' operands are padded so, `grouped_fp8._cuda_wgrad`) 1 loads them
unmasked through pointers (148 at model M's shape on an H100,
docs/benchmarks/moe_fp8_host_h100_2026-12-05b.md) and 2 (sm_90 and later) through TMA
descriptors built on the host (342 there, docs/benchmarks/moe_fp8_tma_h100_2026-12-05c.md;
bf16 `torch._grouped_mm` 545).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Tile shapes tried once per (N, K) (BLOCK_M and BLOCK_K stay 128: the row-tile schedule is
# built with BLOCK_M, and blockwise scales come per 128 of K).
_CONFIGS = [
    triton.Config({"BLOCK_N": block_n}, num_warps=8, num_stages=stages)
    for block_n in (128, 256)
    for stages in (3, 4)
]


@triton.jit
def _k_step(src, ptrs, row0, k0, ks, K, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """One K block of a K-contiguous operand: through its TMA descriptor from (row0, k0) (rows
    and K past the operand read as zeros), or through pointers (ptrs: the tile's k = 0)."""
    if TMA:
        tile = src.load([row0, k0])
    elif EVEN_K:
        tile = tl.load(ptrs + k0)
    else:
        tile = tl.load(ptrs + k0, mask=((k0 + ks) < K)[None, :], other=0.0)
    return tile


def set_descriptor_tiles(nargs, tiles: dict) -> None:
    """Set the TMA descriptors' tiles of a launch: tiles {argument: (meta name of the tile's
    rows, of its columns)}, read from the launch's meta (the config the autotuner tries)."""
    for name, (rows, cols) in tiles.items():
        nargs[name].block_shape = [nargs[rows], nargs[cols]]


def _tiled_configs(tiles: dict, reads_descriptors) -> list:
    """_CONFIGS, each with a pre_hook that sets the descriptors' tiles of that config when the
    launch reads through descriptors (`reads_descriptors(nargs)`)."""

    def hook(nargs):
        if reads_descriptors(nargs):
            set_descriptor_tiles(nargs, tiles)

    return [
        triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=hook)
        for c in _CONFIGS
    ]


RAGGED_M_TILES = {"a_src": ("BLOCK_M", "BLOCK_K"), "b_src": ("BLOCK_N", "BLOCK_K")}
_RAGGED_M_CONFIGS = _tiled_configs(RAGGED_M_TILES, lambda nargs: nargs["TMA"])


@triton.autotune(configs=_RAGGED_M_CONFIGS, key=["N", "K", "SCALES", "FAST", "TMA", "A_DTYPE"])
@triton.jit
def _ragged_m_kernel(
    a_src,
    b_src,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    tile_group_ptr,
    tile_row_ptr,
    group_end_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bg,
    stride_bn,
    stride_cm,
    stride_sm,
    stride_sk,
    SCALES: tl.constexpr,
    FAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    A_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # N tiles fastest: the programs running together share their A row tile (read once into
    # L2) and, over a group's row tiles, its B[g].
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    group = tl.load(tile_group_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(group_end_ptr + group)
    if row0 >= row_end:  # a tile past the last real one (the schedule's bound)
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows = tl.minimum(rows, M - 1)  # read, never stored: the store keeps rows < row_end
    b_cols = tl.minimum(cols, N - 1)
    a_ptrs = a_src
    b_ptrs = b_src
    if not TMA:
        a_ptrs = a_src + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        b_ptrs = b_src + group.to(tl.int64) * stride_bg + b_cols[:, None] * stride_bn + ks[None, :]
    b_row0 = group * N + pid_n * BLOCK_N  # TMA: B's rows as [G x N, K] (past N: dropped)
    k_blocks = (K + BLOCK_K - 1) // BLOCK_K  # blockwise: BLOCK_K is the 128 of the scales
    n_blocks = (N + 127) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _k_step(a_src, a_ptrs, row0, k0, ks, K, EVEN_K, TMA)
        b = _k_step(b_src, b_ptrs, b_row0, k0, ks, K, EVEN_K, TMA)
        if SCALES == 2:
            # scale_inv of A: [M, k_blocks] (1x128) at strides (stride_sm, stride_sk): an
            # outer-dim-major grid (stride_sm 1) is read along M in one coalesced load; of
            # B: [G, ceil(N/128), k_blocks] (128x128), contiguous.
            kb = k0 // BLOCK_K
            a_s = tl.load(a_scale_ptr + a_rows.to(tl.int64) * stride_sm + kb * stride_sk)
            b_s = tl.load(b_scale_ptr + (group * n_blocks + b_cols // 128) * k_blocks + kb)
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        elif FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
    if SCALES == 1:
        acc = (
            acc * tl.load(a_scale_ptr + a_rows * stride_sm)[:, None] * tl.load(b_scale_ptr + group)
        )
    elif SCALES == 0:
        acc = acc * tl.load(a_scale_ptr) * tl.load(b_scale_ptr + group)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    keep = (rows < row_end)[:, None] & (cols < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _token_tile(
    src, rows, row_ok, stride, row0, m0, ms, end, MODE: tl.constexpr, BLOCK_M: tl.constexpr
):
    """[rows, BLOCK_M tokens from m0] of an M-contiguous operand, zeros at and past `end`.
    MODE 0: masked pointer loads. 1 (whole tiles: m0 a multiple of BLOCK_M, the tile inside
    the group, rows clamped to real ones and dropped at the store): unmasked pointer loads,
    vectorized. 2 (whole tiles): `src` is a TMA descriptor of the operand, the tile from row
    row0 (rows past the operand read as zeros)."""
    if MODE == 2:  # one static branch each: a descriptor has no pointer arithmetic
        tile = src.load([row0, m0])
    elif MODE == 1:
        m0 = tl.multiple_of(m0, BLOCK_M)
        tile = tl.load(src + rows[:, None].to(tl.int64) * stride + (m0 + ms)[None, :])
    else:
        offsets = rows[:, None].to(tl.int64) * stride + (m0 + ms)[None, :]
        mask = row_ok[:, None] & ((m0 + ms) < end)[None, :]
        tile = tl.load(src + offsets, mask=mask, other=0.0)
    return tile


@triton.jit
def _tile_rows(pid, rows, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """A tile's rows of an operand [rows, M]: (the rows, the rows read, which are real, the
    first row). The rows read are clamped to real ones with whole tiles through pointers
    (MODE 1; the extra ones are dropped at the store)."""
    tile_rows = pid * BLOCK + tl.arange(0, BLOCK)
    read = tl.minimum(tile_rows, rows - 1) if MODE == 1 else tile_rows
    return tile_rows, read, tile_rows < rows, pid * BLOCK


RAGGED_K_TILES = {"a_ptr": ("BLOCK_N", "BLOCK_M"), "b_ptr": ("BLOCK_K", "BLOCK_M")}
_RAGGED_K_CONFIGS = _tiled_configs(RAGGED_K_TILES, lambda nargs: nargs["MODE"] == 2)


def _ragged_k_tuner(adds_into_c: bool):
    """The ragged-K kernel's autotuner. Tuning runs the kernel once per config: a kernel that
    adds into C needs C restored after each run (restore_value: a transient copy of C, which
    is an expert grad slot [E, N, K] in fp32, 0.75 GiB at model M's fc1); one that writes C
    needs no copy. So the two are separate tuners of one kernel, ACCUMULATE picking which."""
    key = ["N", "K", "BLOCKWISE", "FAST", "SEGMENTED", "MODE", "A_DTYPE", "ACCUMULATE"]
    restore = ["c_ptr"] if adds_into_c else None
    return triton.autotune(configs=_RAGGED_K_CONFIGS, key=key, restore_value=restore)


@triton.jit
def _ragged_k_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    group_start_ptr,
    chunk_start_ptr,
    group_segment_ptr,
    N,
    K,
    stride_an,
    stride_bk,
    stride_cg,
    stride_cn,
    stride_scale,
    BLOCKWISE: tl.constexpr,
    FAST: tl.constexpr,
    SEGMENTED: tl.constexpr,
    MODE: tl.constexpr,
    A_DTYPE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # A group's (N, K) tiles run together (group slowest): its tokens' slab of A and B is read
    # into L2 once, not once per program as when consecutive programs were other groups'.
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) % n_tiles
    pid_k = tl.program_id(0) // n_tiles
    group = tl.program_id(1)
    ns, a_rows, n_ok, a_row0 = _tile_rows(pid_n, N, MODE, BLOCK_N)
    kk, b_rows, k_ok, b_row0 = _tile_rows(pid_k, K, MODE, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if SEGMENTED:
        # Per tensor, a group of several segments (group_start_ptr: the segments' starts),
        # each with its own scale_inv pair ([S] each): every tile's product is scaled by its
        # segment's before it is added, so the group's sum needs no buffer per segment.
        first = tl.load(group_segment_ptr + group)
        last = tl.load(group_segment_ptr + group + 1)
        for segment in range(first, last):
            start = tl.load(group_start_ptr + segment)
            end = tl.load(group_start_ptr + segment + 1)
            scale = tl.load(a_scale_ptr + segment) * tl.load(b_scale_ptr + segment)
            for m0 in range(start, end, BLOCK_M):
                a = _token_tile(a_ptr, a_rows, n_ok, stride_an, a_row0, m0, ms, end, MODE, BLOCK_M)
                b = _token_tile(b_ptr, b_rows, k_ok, stride_bk, b_row0, m0, ms, end, MODE, BLOCK_M)
                acc += tl.dot(a, tl.trans(b)) * scale
    else:
        start = tl.load(group_start_ptr + group)
        end = tl.load(group_start_ptr + group + 1)
        # Blockwise: the group's first 128-token chunk in the scale grids [N, C] / [K, C].
        chunk = tl.load(chunk_start_ptr + group)
        a_scale_rows = a_scale_ptr + ns.to(tl.int64) * stride_scale
        b_scale_rows = b_scale_ptr + kk.to(tl.int64) * stride_scale
        for m0 in range(start, end, BLOCK_M):
            a = _token_tile(a_ptr, a_rows, n_ok, stride_an, a_row0, m0, ms, end, MODE, BLOCK_M)
            b = _token_tile(b_ptr, b_rows, k_ok, stride_bk, b_row0, m0, ms, end, MODE, BLOCK_M)
            if BLOCKWISE:
                # 128x1 cells along the tokens (BLOCK_M is their 128), counted from the group
                # start: each chunk's product scaled before it is added, as the ragged-M
                # kernel's K blocks.
                a_s = tl.load(a_scale_rows + chunk, mask=n_ok, other=0.0)
                b_s = tl.load(b_scale_rows + chunk, mask=k_ok, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
                chunk += 1
            elif FAST:
                acc = tl.dot(a, tl.trans(b), acc)
            else:
                acc += tl.dot(a, tl.trans(b))
        if not BLOCKWISE:  # per tensor: a scalar each (stride_scale 0) or one per group (1)
            acc = acc * tl.load(a_scale_ptr + group * stride_scale)
            acc = acc * tl.load(b_scale_ptr + group * stride_scale)
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + ns[:, None] * stride_cn + kk[None, :]
    c_ok = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:  # gradient accumulation fusion: C + this product, rounded once
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


# ACCUMULATE=True launches go to _ragged_k_add_kernel, the others to _ragged_k_kernel (one jit
# function, so profiles name both _ragged_k_kernel).
_ragged_k_add_kernel = _ragged_k_tuner(adds_into_c=True)(_ragged_k_kernel)
_ragged_k_kernel = _ragged_k_tuner(adds_into_c=False)(_ragged_k_kernel)


@triton.jit
def _transpose_bytes_kernel(
    src_ptr,
    dst_ptr,
    source_ptr,
    cols,
    length,
    src_batch,
    src_row,
    dst_batch,
    dst_row,
    HAS_SOURCE: tl.constexpr,
    BP: tl.constexpr,
    BC: tl.constexpr,
):
    """dst[b, c, p] = src[b, source[p], c] for bytes, 0 where source[p] < 0 (source[p] = p
    without HAS_SOURCE): the grouped GEMMs' transposed operands. One BP x BC tile of the
    output's columns p and rows c per program: it gathers BP source rows (BC contiguous bytes
    each), transposes them in registers and writes BP contiguous bytes per output row (a
    scatter to computed columns could not be vectorized: 23x slower, issue 38)."""
    b = tl.program_id(2).to(tl.int64)
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    if HAS_SOURCE:
        row = tl.load(source_ptr + p, mask=p < length, other=-1)
    else:
        row = tl.where(p < length, p, -1)
    ok = (row >= 0)[:, None] & (c[None, :] < cols)
    src = src_ptr + b * src_batch + row.to(tl.int64)[:, None] * src_row + c[None, :]
    tile = tl.load(src, mask=ok, other=0)
    dst = dst_ptr + b * dst_batch + c.to(tl.int64)[:, None] * dst_row + p[None, :]
    tl.store(dst, tl.trans(tile), mask=(c[:, None] < cols) & (p[None, :] < length))
