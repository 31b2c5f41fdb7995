"""FP8 grouped GEMMs for the MoE experts: many small GEMMs, one per group (expert), in one launch.

- `grouped_scaled_mm`: Y[rows of g] = A[rows of g] @ B[g]^T (forward and data gradient);
- `grouped_scaled_mm_wgrad`: C[g] = A[:, cols of g] @ B[:, cols of g]^T (weight gradient, from
  the transposed copies of the output gradient and the input).

On CUDA with Triton they run the kernels of `triton_grouped_gemm.py`; elsewhere (and with
`emulate`), one `gemm.emulated_mm` per group: exact dequantization, fp32 products, the CPU twin
the tests compare the kernels with. Why not only torch's `_scaled_grouped_mm` (torch 2.11, H200,
docs/benchmarks/grouped_gemm_fp8stats_h200_2026-12-04b.md): it refuses E5M2 operands (our
gradients under `hybrid`) and fp32 output, has no blockwise scales, and its precise
accumulation runs at 309 TFLOP/s on fc2 where an unmasked Triton kernel like ours ran at 589.

Scales are scale_inv as in `gemm.scaled_mm`: per-tensor recipes (tensorwise, delayed) a scalar
for A (or one per row, [M]) and one per group for B ([G]); blockwise 1x128 for A ([M,
ceil(K/128)]) and 128x128 for B ([G, ceil(N/128), ceil(K/128)]); the weight gradient's
blockwise scales are 1x128 cells along the tokens of each group (see
`grouped_scaled_mm_wgrad`). mxfp8 (no sm_90 instruction) is
always emulated.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.fp8.cuda.gemm import emulated_mm
from megatron.core.fp8.cuda.launch import aligned_16
from megatron.core.fp8.recipe import recipe_spec

_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension (the ragged-M kernel's row tiles)."""

BLOCK_M, BLOCK_K = 128, 128
"""Rows per tile of the ragged-M kernel (its schedule built on the device) and K per step
(the blockwise scales' 128); BLOCK_N is autotuned."""


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from megatron.core.fp8.cuda import triton_grouped_gemm
    except ImportError:
        return None
    return triton_grouped_gemm


def _triton_runs(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and _kernels() is not None and torch.version.hip is None


def _kernel_runs(recipe: str, *tensors: torch.Tensor) -> bool:
    return not recipe_spec(recipe).e8m0_scales and _triton_runs(*tensors)


TRANSPOSE_TILE = (64, 128)
"""Output columns and rows of bytes per program of the byte transpose (the fastest of the
tiles timed by dev/bench_transpose_bytes.py on an H100: 2.6 TB/s, a copy's 2.9)."""


def transpose_bytes(data: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
    """The transpose of FP8 (or uint8) bytes, in data's dtype: [B, R, C] -> [B, C, R], or
    [R, C] -> [C, R]; with `source` (2-D only; integers, [P]), [C, P] with column p row
    source[p] of data, zeros where source[p] < 0. CUDA: one tiled kernel (the strided copy
    torch makes of a transposed byte view writes a byte per row); elsewhere torch."""
    flat = data.view(torch.uint8)
    if source is not None and data.dim() != 2:
        raise ValueError("transpose_bytes: a source list transposes 2-D bytes only")
    if not _triton_runs(data):
        if source is not None:  # index -1 picks the zero row appended last
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])[source.clamp(min=-1)]
        return flat.transpose(-2, -1).contiguous().view(data.dtype)
    batched = (flat if flat.dim() == 3 else flat[None]).contiguous()
    batch, rows, cols = batched.shape
    length = rows if source is None else source.shape[0]  # source[p] < rows: the caller's
    out = batched.new_empty(batch, cols, length)
    if out.numel():
        bp, bc = TRANSPOSE_TILE
        grid = (triton_cdiv(length, bp), triton_cdiv(cols, bc), batch)
        _kernels()._transpose_bytes_kernel[grid](
            batched, out, batched if source is None else source.contiguous(), cols, length,
            batched.stride(0), batched.stride(1), out.stride(0), out.stride(1),
            HAS_SOURCE=source is not None, BP=bp, BC=bc,
        )  # fmt: skip
    return (out if flat.dim() == 3 else out[0]).view(data.dtype)


def _group_offsets(group_sizes: list[int]) -> list[int]:
    offsets = [0]
    for size in group_sizes:
        if size < 0:
            raise ValueError(f"group sizes must be >= 0, got {group_sizes}")
        offsets.append(offsets[-1] + size)
    return offsets


GroupSizes = list[int] | torch.Tensor
"""Rows (tokens) per group: a list, checked on the host, or an integer tensor on the operands'
device, taken as it is (no host sync: a compiled caller keeps one graph; the caller vouches
that it is >= 0 and sums to the rows, or for the weight gradient to at most the tokens)."""


def _host_sizes(group_sizes: GroupSizes) -> list[int]:
    if isinstance(group_sizes, torch.Tensor):
        return group_sizes.tolist()
    _group_offsets(group_sizes)  # the check
    return list(group_sizes)


def _device_sizes(group_sizes: GroupSizes, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(group_sizes, device=device).to(torch.int64)


def tile_schedule(sizes: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The ragged-M kernel's (group, first row) of each BLOCK_M-row tile inside one group, and
    each group's end row, built on the device: as many tiles as any sizes summing to `rows`
    can need (ceil of each group's rows / BLOCK_M), the ones past the last real tile given
    row `rows` (the kernel returns at once)."""
    groups = sizes.shape[0]
    ends = sizes.cumsum(0)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_ends = tiles.cumsum(0)
    bound = (rows + groups * (BLOCK_M - 1)) // BLOCK_M
    tile = torch.arange(bound, device=sizes.device)
    group = torch.searchsorted(tile_ends, tile, right=True)
    real = group < groups
    group = group.clamp(max=groups - 1)
    row = ends[group] - sizes[group] + (tile - tile_ends[group] + tiles[group]) * BLOCK_M
    row = torch.where(real, row, rows)
    return group.to(torch.int32), row.to(torch.int32), ends.to(torch.int32)


def grouped_scaled_mm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    *,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    group_sizes: GroupSizes,
    recipe: str,
    out_dtype: torch.dtype = torch.bfloat16,
    emulate: bool = False,
    fast_accum: bool = False,
    schedule: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """A [M, K] FP8 (rows sorted by group, group_sizes[g] rows each) and B [G, N, K] FP8 ->
    [M, N] in out_dtype: each group's rows times its own B[g]^T. Per-tensor recipes also take
    one A scale_inv per row ([M]: each row's segment's, applied to its fp32 sum; emulated as
    1x128 cells of equal values). fast_accum: the kernel's
    per-tensor accumulation mode (as the dense GEMM's; blockwise always adds per K block).
    schedule: `tile_schedule(group sizes, M)` when the caller already has it (several GEMMs
    over the same groups build it once)."""
    groups, n, k = b_data.shape
    rows = a_data.shape[0]
    listed = not isinstance(group_sizes, torch.Tensor)
    if (
        len(group_sizes) != groups
        or a_data.shape[1] != k
        or (listed and _group_offsets(group_sizes)[-1] != rows)
    ):
        raise ValueError(
            f"A {tuple(a_data.shape)} with group sizes {group_sizes} does not match "
            f"B {tuple(b_data.shape)}"
        )
    per_tensor = recipe_spec(recipe).per_tensor
    row_scales = per_tensor and a_scale_inv.numel() > 1
    if per_tensor and not row_scales:
        a_scale_inv = a_scale_inv.reshape(())  # a scalar, also when given as [1]
    elif row_scales and tuple(a_scale_inv.shape) != (rows,):
        raise ValueError(
            f"per-tensor A scale_inv is a scalar or one per row ({rows},), "
            f"got {tuple(a_scale_inv.shape)}"
        )
    if emulate or not _kernel_runs(recipe, a_data, b_data):
        offsets = _group_offsets(_host_sizes(group_sizes))
        if row_scales:  # constant along K: the same values as 1x128 cells of each row
            a_scale_inv, b_scale_inv = _row_scales_as_cells(a_scale_inv, b_scale_inv, n, k)
            recipe = "blockwise"
        return _emulated_ragged_m(
            a_data, b_data, a_scale_inv, b_scale_inv, offsets, recipe, out_dtype
        )
    out = torch.empty(rows, n, dtype=out_dtype, device=a_data.device)
    if rows == 0 or n == 0:
        return out
    if schedule is None:
        schedule = tile_schedule(_device_sizes(group_sizes, a_data.device), rows)
    tile_group, tile_row, group_end = schedule
    if tile_group.shape[0] > _GRID_Y:
        raise ValueError(f"{rows} rows need more than {_GRID_Y} row tiles of {BLOCK_M}")
    grid = lambda meta: (triton_cdiv(n, meta["BLOCK_N"]), tile_group.shape[0])  # noqa: E731
    # The kernel reads K-contiguous bytes, A's scales at their strides (a 1x128 grid from the
    # fused quantizers is outer-dim-major: read along M in one load) and B's row-major.
    a_data, b_data = a_data.contiguous(), b_data.contiguous()
    b_scale_inv = b_scale_inv.contiguous()
    a_scale_strides = a_scale_inv.stride() if a_scale_inv.dim() else (0,)
    a_scale_strides = (*a_scale_strides, 0)[:2]  # (along M, along K): 0 where it has none
    tma = _tma_operands(a_data, b_data)
    a_src = _operand_source(a_data, tma)
    b_src = _operand_source(b_data.view(groups * n, k), tma)  # [G x N, K] rows
    scales = 2 if not per_tensor else int(row_scales)  # the kernel's SCALES
    _kernels()._ragged_m_kernel[grid](
        a_src, b_src, out, a_scale_inv, b_scale_inv, tile_group, tile_row, group_end,
        rows, n, k, a_data.stride(0), b_data.stride(0), b_data.stride(1), out.stride(0),
        *a_scale_strides, SCALES=scales, FAST=fast_accum, EVEN_K=k % BLOCK_K == 0, TMA=tma,
        A_DTYPE=str(a_data.dtype),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def _row_scales_as_cells(a_scale_inv, b_scale_inv, n, k):
    """Per-tensor row scales [M] and group scales [G] as 1x128 and 128x128 cells."""
    k_blocks, n_blocks = triton_cdiv(k, BLOCK_K), triton_cdiv(n, 128)
    rows, groups = a_scale_inv.shape[0], b_scale_inv.shape[0]
    a_cells = a_scale_inv[:, None].expand(rows, k_blocks).contiguous()
    return a_cells, b_scale_inv[:, None, None].expand(groups, n_blocks, k_blocks).contiguous()


def _check_segment_group(segment_group, segments, a_scale_inv, b_scale_inv, spec) -> None:
    """segment_group: one ascending group index per segment, every group from 0 listed; a
    per-tensor recipe with one scale per segment."""
    scales = (a_scale_inv.shape, b_scale_inv.shape) == ((segments,), (segments,))
    groups = sorted(set(segment_group))
    if not spec.per_tensor or not scales or len(segment_group) != segments:
        raise ValueError("segment_group takes a per-tensor recipe with one scale per segment")
    if list(segment_group) != sorted(segment_group) or groups != list(range(len(groups))):
        raise ValueError(f"segment_group must list groups 0, 1, ... in order: {segment_group}")


def _check_wgrad(a_t_data, b_t_data, a_scale_inv, b_scale_inv, group_sizes, spec, options):
    """Shapes of `grouped_scaled_mm_wgrad`'s operands; listed sizes also against the tokens
    (and, with whole_tiles, whole 128-token tiles). options: (segment_group, whole_tiles)."""
    segment_group, whole_tiles = options
    if spec.e8m0_scales:
        raise ValueError(f"grouped_scaled_mm_wgrad takes fp32 scales, not '{spec.name}'")
    if segment_group is not None:
        _check_segment_group(segment_group, len(group_sizes), a_scale_inv, b_scale_inv, spec)
    (n, m), k = a_t_data.shape, b_t_data.shape[0]
    listed = not isinstance(group_sizes, torch.Tensor)
    if whole_tiles and listed and any(size % BLOCK_K for size in group_sizes):
        raise ValueError(f"whole_tiles: group sizes must be multiples of 128, got {group_sizes}")
    if b_t_data.shape[1] != m or (listed and _group_offsets(group_sizes)[-1] != m):
        raise ValueError(
            f"A^T {tuple(a_t_data.shape)}, B^T {tuple(b_t_data.shape)} and group sizes "
            f"{group_sizes} do not match"
        )
    if spec.per_tensor:
        if (a_scale_inv.dim(), b_scale_inv.dim()) not in ((0, 0), (1, 1)):
            raise ValueError("per-tensor wgrad scales are scalars or one per group each")
        return
    cells = _group_offsets([triton_cdiv(s, BLOCK_K) for s in group_sizes])[-1] if listed else None
    c = a_scale_inv.shape[-1] if a_scale_inv.dim() == 2 else -1
    if a_scale_inv.shape != (n, c) or b_scale_inv.shape != (k, c) or (listed and c != cells):
        raise ValueError(
            f"blockwise wgrad scales must be ({n}, C) and ({k}, C) with C = {cells or 'the cells'}"
            f", got {tuple(a_scale_inv.shape)} and {tuple(b_scale_inv.shape)}"
        )


def group_offsets(sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's first token and first 128-token chunk, and their totals (int32 [G + 1]
    each) of tokens per group (on the device): the ragged-K kernel's group bounds."""
    zero = sizes.new_zeros(1)
    chunks = (sizes + BLOCK_K - 1) // BLOCK_K
    starts = torch.cat([zero, sizes.cumsum(0)]).to(torch.int32)
    return starts, torch.cat([zero, chunks.cumsum(0)]).to(torch.int32)


def grouped_scaled_mm_wgrad(
    a_t_data: torch.Tensor,
    b_t_data: torch.Tensor,
    *,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    group_sizes: GroupSizes,
    recipe: str,
    out_dtype: torch.dtype = torch.float32,
    emulate: bool = False,
    fast_accum: bool = False,
    segment_group: list[int] | None = None,
    whole_tiles: bool = False,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """A^T [N, M] and B^T [K, M] FP8 (tokens along M, sorted by group) -> [G, N, K]: for each
    group g, A^T[:, cols of g] @ B^T[:, cols of g]^T. Scales: per-tensor recipes a scalar
    each or one per group ([G] each); blockwise 1x128 cells along M counted from each GROUP's
    start (a group of m tokens has ceil(m/128) cells, the last one short): A [N, C], B [K, C],
    group g's cells from the sum of the earlier groups' counts (a device `group_sizes` may
    leave tokens and cells unused past the last group). fast_accum: per-tensor only.
    segment_group (per tensor): group_sizes are segments, segment s of group
    segment_group[s] (ascending, every group listed), each with its own scales ([S] each);
    each group's segments are summed in the kernel (no fast accumulation). whole_tiles: every
    size is a multiple of 128 (padded operands; listed sizes are checked): the kernel reads
    whole 128-token tiles without masks. offsets: `group_offsets` of these sizes when the
    caller has them (built once per layer call, as the ragged-M kernel's schedule). out: a
    contiguous [G, N, K] tensor of out_dtype that the result is written into (overwritten, or
    with `accumulate` added to, out + the fp32 product rounded once; gradient accumulation
    fusion: the engine's grad buffer)."""
    if accumulate and out is None:
        raise ValueError("grouped_scaled_mm_wgrad: accumulate needs out")
    spec = recipe_spec(recipe)
    segmented = segment_group is not None
    options = (segment_group, whole_tiles)
    _check_wgrad(a_t_data, b_t_data, a_scale_inv, b_scale_inv, group_sizes, spec, options)
    n, k, groups = a_t_data.shape[0], b_t_data.shape[0], len(group_sizes)
    if segmented:
        groups = segment_group[-1] + 1 if segment_group else 0
    if emulate or not _kernel_runs(recipe, a_t_data, b_t_data):
        operands = (a_t_data, b_t_data, a_scale_inv, b_scale_inv, recipe)
        shape = (groups, n, k)
        result = _emulated_kernel_wgrad(
            *operands, group_sizes, segment_group, shape, out_dtype, accumulate
        )
        if out is None:
            return result
        _checked_out(out, shape, out_dtype)
        return out.add_(result) if accumulate else out.copy_(result)
    if out is None:
        out = torch.empty(groups, n, k, dtype=out_dtype, device=a_t_data.device)
    _checked_out(out, (groups, n, k), out_dtype)
    starts, chunk_starts = offsets or group_offsets(_device_sizes(group_sizes, out.device))
    blockwise = not spec.per_tensor
    # The scales' stride per chunk (blockwise: their rows hold C chunks) or per group.
    scale_stride = a_scale_inv.shape[1] if blockwise else int(a_scale_inv.dim() == 1)
    group_segments = starts  # read only when segmented: each group's first segment
    if segmented:
        index = torch.tensor(segment_group, dtype=torch.long, device=out.device)
        per_group = torch.bincount(index, minlength=groups)
        group_segments = torch.cat([index.new_zeros(1), per_group.cumsum(0)]).to(torch.int32)
    grid = lambda meta: (triton_cdiv(n, meta["BLOCK_N"]) * triton_cdiv(k, BLOCK_K), groups)  # noqa: E731
    a_t_data, b_t_data = a_t_data.contiguous(), b_t_data.contiguous()  # M-contiguous rows
    fast = fast_accum and not blockwise and not segmented
    mode = 2 if whole_tiles and _tma_operands(a_t_data, b_t_data) else int(whole_tiles)
    a_src, b_src = (_operand_source(t, mode == 2) for t in (a_t_data, b_t_data))
    kernels = _kernels()
    kernel = kernels._ragged_k_add_kernel if accumulate else kernels._ragged_k_kernel
    kernel[grid](
        a_src, b_src, out, a_scale_inv.contiguous(), b_scale_inv.contiguous(), starts,
        chunk_starts, group_segments, n, k, a_t_data.stride(0), b_t_data.stride(0),
        out.stride(0), out.stride(1), scale_stride, BLOCKWISE=blockwise, FAST=fast,
        SEGMENTED=segmented, MODE=mode, A_DTYPE=str(a_t_data.dtype), ACCUMULATE=accumulate,
        BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_K,
    )  # fmt: skip
    return out


def _emulated_kernel_wgrad(a_t, b_t, a_scale_inv, b_scale_inv, recipe, group_sizes, segment_group,
                    shape, out_dtype, accumulate):  # fmt: skip
    """`grouped_scaled_mm_wgrad` where its kernel does not run: the kernel's sums emulated,
    [G, N, K] in out_dtype (fp32 when it will be added to an output: rounded once there)."""
    sizes = _host_sizes(group_sizes)
    offsets, chunks = _group_offsets(sizes), _group_offsets([-(-s // BLOCK_K) for s in sizes])
    segmented = segment_group is not None
    piece_dtype = torch.float32 if segmented or accumulate else out_dtype
    pieces = _emulated_ragged_k(
        a_t, b_t, a_scale_inv, b_scale_inv, offsets, chunks, recipe, piece_dtype
    )
    if not segmented:
        return pieces.reshape(shape)
    index = torch.tensor(segment_group, dtype=torch.long, device=pieces.device)
    result = pieces.new_zeros(shape).index_add_(0, index, pieces)
    return result if accumulate else result.to(out_dtype)


def _checked_out(out: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"grouped_scaled_mm_wgrad: out must be a contiguous {tuple(shape)} {dtype} tensor, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    return out


def _tma_operands(*operands: torch.Tensor) -> bool:
    """The kernels read these 2-D (or stacked) operands through TMA descriptors: sm_90 and
    later, 16-byte aligned bases and rows (as TMA needs)."""
    aligned = all(aligned_16(t) and t.stride(-2) * t.element_size() % 16 == 0 for t in operands)
    return aligned and _tma_runs(operands[0].device)


def _tma_runs(device: torch.device) -> bool:
    """Triton's host-built TMA descriptors on this device (sm_90 and later)."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability_major(index) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    """A CUDA device's compute capability major, looked up once (every GEMM call asks)."""
    return torch.cuda.get_device_capability(index)[0]


def _operand_source(data: torch.Tensor, tma: bool):
    """What a kernel reads a 2-D operand through: the tensor, or its TMA descriptor (the tile
    set per config by the autotuner's hook)."""
    if not tma:
        return data
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(data, [BLOCK_K, BLOCK_K])


def _group_scale(scale_inv, group, cells, per_tensor):
    if per_tensor:
        return scale_inv[group] if scale_inv.dim() == 1 else scale_inv
    return scale_inv[:, cells]


def _emulated_ragged_k(a_t, b_t, a_scale_inv, b_scale_inv, offsets, chunks, recipe, out_dtype):
    """One exact emulated GEMM per group (the CPU twin of `_ragged_k_kernel`)."""
    per_tensor = recipe_spec(recipe).per_tensor
    pieces = []
    for g in range(len(offsets) - 1):
        cols, cells = slice(offsets[g], offsets[g + 1]), slice(chunks[g], chunks[g + 1])
        pieces.append(
            emulated_mm(
                a_t[:, cols],
                b_t[:, cols],
                a_scale_inv=_group_scale(a_scale_inv, g, cells, per_tensor),
                b_scale_inv=_group_scale(b_scale_inv, g, cells, per_tensor),
                recipe=recipe,
                out_dtype=out_dtype,
            )
        )
    return torch.stack(pieces)


def triton_cdiv(value: int, block: int) -> int:
    return -(-value // block)


def _emulated_ragged_m(a_data, b_data, a_scale_inv, b_scale_inv, offsets, recipe, out_dtype):
    """One exact emulated GEMM per group (the CPU twin of `_ragged_m_kernel`)."""
    per_tensor = recipe_spec(recipe).per_tensor
    pieces = []
    for g in range(b_data.shape[0]):
        rows = slice(offsets[g], offsets[g + 1])
        pieces.append(
            emulated_mm(
                a_data[rows],
                b_data[g],
                a_scale_inv=a_scale_inv if per_tensor else a_scale_inv[rows],
                b_scale_inv=b_scale_inv[g],
                recipe=recipe,
                out_dtype=out_dtype,
            )
        )
    if not pieces:
        return a_data.new_zeros(0, b_data.shape[1], dtype=out_dtype)
    return torch.cat(pieces)
