"""The FP8 operands of the experts' grouped GEMMs (`grouped_fp8.py`), each quantized in one
pass over all tokens (or all experts) with the bytes and scales the per-segment path
(`fp8_experts.grouped_fp8_gemm`: one Fp8Linear call per segment) gives each piece.

Tokens [M, K] sorted by expert, in segments (the rows of one expert from one source rank):
- per tensor (tensorwise): one scale per segment (`quantize_segments`); the rowwise bytes are
  also the transposed operand of the weight gradient (scale_inv [S]);
- blockwise: 1x128 cells along K, which never cross a row, so all rows at once
  (`quantize_rows`, scale_inv [M, ceil(K/128)]); the weight gradient's columnwise copy has
  128x1 cells along the tokens counted from each SEGMENT's start (`quantize_segment_operands`:
  each segment zero-padded to a multiple of 128 rows, as quantizing it alone pads it; kept
  transposed and padded, [K, 128 C], with scale_inv [K, C] (`padded_rows`: C the segments'
  cells for sizes known on the host, for sizes on the device the most any sizes can need),
  segment s's cells at `chunk_bounds[s]`).
Segment sizes are read on the device (a tensor): nothing here waits for the host to know
them, so a compiled MoE layer keeps one graph. The per-tensor token and weight passes are
torch ops that a compiled layer fuses; called eagerly (delayed scaling's experts,
--no-torch-compile) they run compiled on CUDA (`fused_pass.fused`), not a kernel per op.
Blockwise operands come from the dense Fp8Linear's quantizers (`backend_for(x)`: the fused
CUDA kernels on a GPU, the reference elsewhere; the same bytes), run once on the padded
tokens or on the stacked weight's padded rows.
Weights [E, N, K]: each expert on its own (per tensor: scale_inv [E]; blockwise: 128x128 cells,
scale_inv [E, ceil(N/128), ceil(K/128)]), quantized here (`quantize_experts`) or read as they
are from an FP8 parameter of Megatron-FSDP (`stacked_operand`: rowwise for the forward; for
the data gradient the transpose of the bytes `ExpertWeight` transposes, `transposed_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import fused_pass
from megatron.core.fp8.cuda.grouped_gemm import transpose_bytes
from megatron.core.fp8.quantization import backend_for
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import RecipeSpec
from megatron.core.fp8.reference import reciprocal, saturating_cast, scale_from_amax
from megatron.core.numerics import amax_ignoring_nan

Operand = tuple[torch.Tensor, torch.Tensor]
"""(FP8 bytes as their FP8 dtype, fp32 scale_inv) of one grouped operand."""


def segment_ids(sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """The segment index of each of the `rows` rows (sizes: rows per segment, on the device,
    summing to `rows`; no host sync)."""
    ids = torch.arange(sizes.shape[0], device=sizes.device)
    return torch.repeat_interleave(ids, sizes, output_size=rows)


def bounds(sizes: list[int]) -> list[int]:
    """Start offsets of consecutive pieces of `sizes` and the total at the end."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return starts


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on `device`, copied without waiting for the device's
    queued work (torch.tensor(..., device=cuda) synchronizes the stream)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def bf16_grouped_mm_applies(a: torch.Tensor, b: torch.Tensor, dims) -> bool:
    """torch._grouped_mm (CUDA) takes bf16 operands a and b whose row strides, `dims` (every
    dim but the ragged one), are multiples of 16 bytes. Its CPU kernel has no backward (torch
    2.13): CPU callers loop."""
    if not (a.is_cuda and a.dtype == torch.bfloat16 == b.dtype and hasattr(torch, "_grouped_mm")):
        return False
    return all(dim % (16 // a.element_size()) == 0 for dim in dims)


def chunk_bounds(seg_sizes: list[int], block: int) -> list[int]:
    """Where each segment's 128-row cells start in a columnwise scale grid (and their total)."""
    return bounds([-(-size // block) for size in seg_sizes])


def padded_rows(sizes: list[int] | torch.Tensor, rows: int, block: int) -> int:
    """Rows of the segments' padded copy (each segment padded to whole `block`-row cells): for
    host sizes their exact count; for sizes on the device the most that any that many sizes
    summing to `rows` can need, so that no shape depends on them (no host sync)."""
    if isinstance(sizes, torch.Tensor):
        return block * ((rows + sizes.shape[0] * (block - 1)) // block)
    return block * chunk_bounds(sizes, block)[-1]


def padded_positions(seg_ids: torch.Tensor, seg_sizes: torch.Tensor, block: int) -> torch.Tensor:
    """Each row's row in the padded copy: segments in order, each from a multiple of `block`."""
    chunks = (seg_sizes + block - 1) // block
    starts = seg_sizes.cumsum(0) - seg_sizes
    padded_at = block * (chunks.cumsum(0) - chunks)
    rows = torch.arange(seg_ids.shape[0], device=seg_ids.device)
    return rows - starts[seg_ids] + padded_at[seg_ids]


@fused_pass.fused
def quantize_segments(
    x: torch.Tensor,
    seg_ids: torch.Tensor,
    num_segments: int,
    *,
    fp8_dtype,
    power_2_scale: bool,
    tiles: tuple[torch.Tensor, int] | None = None,
) -> Operand:
    """x [M, K] -> (FP8 bytes [M, K] as fp8_dtype, scale_inv [num_segments] fp32): each
    segment's rows quantized tensorwise with the scale of that segment's amax, exactly as
    `quantize` quantizes the segment alone (an empty segment gets scale 1). tiles: the
    segments' padded layout (`padded_sources`, its tile rows) when the caller has it: the
    amaxes reduced per tile first (`segment_amax`)."""
    amax = segment_amax(amax_ignoring_nan(x, dim=-1), seg_ids, num_segments, tiles)
    scale = scale_from_amax(amax, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    return _cast_segments(x, seg_ids, scale, fp8_dtype)


@fused_pass.fused
def quantize_segments_at(
    x: torch.Tensor, seg_ids: torch.Tensor, scale: torch.Tensor, *, fp8_dtype, tiles=None
) -> tuple[Operand, torch.Tensor]:
    """Delayed scaling's `quantize_segments`: each segment's rows at its given scale ([S]
    fp32, its expert's), as `quantize` with that scale quantizes the segment alone; also each
    segment's amax ([S], 0 for an empty one), which delayed scaling records."""
    amax = segment_amax(amax_ignoring_nan(x, dim=-1), seg_ids, scale.shape[0], tiles)
    return _cast_segments(x, seg_ids, scale, fp8_dtype), amax


def _cast_segments(x, seg_ids, scale, fp8_dtype) -> Operand:
    """x's rows at their segment's scale -> (FP8 bytes, scale_inv [S])."""
    scaled = x.to(torch.float32) * scale[seg_ids][:, None]  # quantize reads x in fp32
    return saturating_cast(scaled, fp8_dtype).view(fp8_dtype), reciprocal(scale)


def segment_amax(
    row_amax: torch.Tensor,
    seg_ids: torch.Tensor,
    num_segments: int,
    tiles: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Each segment's largest row amax ([num_segments] fp32, 0 for an empty one). Without
    `tiles`, one scatter of every row into its segment (every row of a segment contends for
    one slot). tiles = (source, tile): the rows laid out padded (`padded_sources`: each
    segment in whole `tile`-row tiles, -1 for padding), reduced per tile, then each
    segment's tiles reduced as one masked [segments, tiles] max (a tile holds one segment's
    rows): a reduction a compiled graph fuses, where a scatter-amax runs as a separate eager
    op. The same values (a max has no order)."""
    if tiles is None or row_amax.numel() == 0:
        amax = torch.zeros(num_segments, dtype=torch.float32, device=row_amax.device)
        return amax.scatter_reduce(0, seg_ids, row_amax.float(), "amax", include_self=True)
    source, tile = tiles
    rows = source.long().clamp(min=0)
    padded = torch.where(source >= 0, row_amax.float()[rows], 0.0)
    tile_amax = padded.view(-1, tile).amax(dim=1)
    tile_segment = seg_ids[rows.view(-1, tile)[:, 0]]  # a tile's first row is real, or all pad
    segments = torch.arange(num_segments, device=row_amax.device)
    owned = tile_segment.unsqueeze(0) == segments.unsqueeze(1)  # [segments, tiles]
    return torch.where(owned, tile_amax.unsqueeze(0), 0.0).amax(dim=1)


def _quantize_operands(x2d, *, spec: RecipeSpec, role, fp8_dtype, power_2_scale, transposed):
    """The (rowwise, transposed) operands the dense Fp8Linear's backend gives x2d: the fused
    CUDA quantizers where they run, else the reference (the same bytes and scales)."""
    return backend_for(x2d).quantize_operands(
        x2d,
        recipe=spec.name,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=True,
        transposed=transposed,
        power_2_scale=power_2_scale,
    )


def _rows_of(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """data[index] of FP8 bytes (gathered as uint8)."""
    return data.view(torch.uint8)[index].view(data.dtype)


def _rows_of_grid(scale_inv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """scale_inv[index] of a [rows, cells] grid, keeping an outer-dim-major grid so."""
    if scale_inv.stride(0) == 1 and scale_inv.shape[1] > 1:
        return scale_inv.t()[:, index].t()
    return scale_inv[index]


def quantize_rows(x: torch.Tensor, *, spec: RecipeSpec, role, fp8_dtype, power_2_scale) -> Operand:
    """Blockwise 1x128 cells of every row: (bytes [M, K], scale_inv [M, ceil(K/128)])."""
    options = dict(spec=spec, role=role, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    row, _ = _quantize_operands(x, transposed=False, **options)
    return row.data, row.scale_inv  # as the quantizer lays it out (the kernel takes strides)


def padded_copy(x: torch.Tensor, position: torch.Tensor, length: int) -> torch.Tensor:
    """x's rows at `position` in `length` zero rows (as quantizing each segment alone pads it;
    zeros past the last segment)."""
    return x.new_zeros(length, x.shape[1]).index_copy_(0, position, x)


def padded_sources(position: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of `padded_positions`: for each of the padded copy's `length` rows the row
    of the tokens it holds, -1 for padding (int32)."""
    rows = torch.arange(position.shape[0], device=position.device, dtype=torch.int32)
    empty = torch.full((length,), -1, dtype=torch.int32, device=position.device)
    return empty.index_copy_(0, position, rows)


def padded_transpose(data: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """FP8 bytes [M, C] -> [C, P]: the transpose in the padded layout of
    `quantize_segment_operands`' columnwise copy (source: `padded_sources`, P rows), so that
    the weight gradient reads whole aligned tiles."""
    return transpose_bytes(data, source)


def quantize_segment_operands(
    x: torch.Tensor,
    seg_ids: torch.Tensor,
    seg_sizes: torch.Tensor,
    *,
    length: int,
    spec: RecipeSpec,
    role,
    fp8_dtype,
    power_2_scale,
    position: torch.Tensor | None = None,
) -> tuple[Operand, Operand]:
    """Blockwise rows (as `quantize_rows`) and the weight gradient's transposed columnwise
    operand: 128x1 cells along the rows of each segment, counted from its first row, as
    bytes [K, P] with each segment padded to whole cells (segment s's tokens at columns
    128 * chunk_bounds[s] onwards, zeros after them; P = `length`, `padded_rows`) and scale_inv
    [K, P / 128] (its cells at chunk_bounds[s]; cells past the last segment's are zeros' and
    unread). One quantization of x with its segments padded; seg_sizes on the device;
    position: `padded_positions` of these segments for spec.block when the caller has them."""
    if position is None:
        position = padded_positions(seg_ids, seg_sizes, spec.block)
    padded = padded_copy(x, position, length)
    options = dict(spec=spec, role=role, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    row, col = _quantize_operands(padded, transposed=True, **options)  # col: [K, P]
    # The rows' scales gathered along M in the grid's own order ([K/128, M] from the fused
    # quantizers, so the grouped GEMM reads each K block's scales of a row tile in one load).
    rows = (_rows_of(row.data, position), _rows_of_grid(row.scale_inv, position))
    return rows, (col.data.contiguous(), col.scale_inv.contiguous())


@fused_pass.fused
def expert_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each expert's max|w| of a stacked weight [E, N, K] ([E] fp32)."""
    return amax_ignoring_nan(weight, dim=(1, 2))


def quantize_experts(
    weight: torch.Tensor, *, spec: RecipeSpec, fp8_dtype, power_2_scale: bool, scale=None
) -> Operand:
    """weight [E, N, K] -> (FP8 bytes, scale_inv): each expert quantized as one Linear weight
    (per tensor: [E]; blockwise 128x128 cells: [E, ceil(N/128), ceil(K/128)]). scale: per
    tensor, the experts' given scales ([E]: delayed scaling's) instead of their amaxes'."""
    if spec.per_tensor:
        return _experts_per_tensor(weight, scale, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    # Each expert's rows padded to whole 128-row cells, so that no cell straddles two experts.
    experts, n, k = weight.shape
    n_pad = -(-n // spec.block) * spec.block
    padded = F.pad(weight, (0, 0, 0, n_pad - n)).reshape(experts * n_pad, k)
    options = dict(spec=spec, role="weight", fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    row, _ = _quantize_operands(padded, transposed=False, **options)
    data = row.data.view(torch.uint8).reshape(experts, n_pad, k)[:, :n].contiguous()
    scale_inv = row.scale_inv.contiguous().reshape(experts, n_pad // spec.block, -1)
    return data.view(fp8_dtype), scale_inv


@fused_pass.fused
def _experts_per_tensor(weight, scale, *, fp8_dtype, power_2_scale: bool) -> Operand:
    """`quantize_experts` per tensor: each expert at its scale ([E]; None: its amax's)."""
    if scale is None:
        scale = scale_from_amax(
            expert_amax(weight), fp8_dtype=fp8_dtype, power_2_scale=power_2_scale
        )
    scaled = weight.to(torch.float32) * scale[:, None, None]
    return saturating_cast(scaled, fp8_dtype).view(fp8_dtype), reciprocal(scale)


def stacked_operand(stacked: QuantizedTensor) -> Operand:
    """The forward's operand of a stacked FP8 parameter: its rowwise bytes [E, N, K] and
    per-expert scale_inv as gathered (what `ExpertWeight` gives each expert's GEMM)."""
    data = stacked.rowwise_data
    if data is None:
        raise ValueError(f"{stacked._label()} was not quantized rowwise")
    return data.view(stacked.fp8_dtype), stacked.rowwise_scale_inv


def transposed_experts(data: torch.Tensor, scale_inv: torch.Tensor) -> Operand:
    """The data gradient's operand [E, K, N] of weight bytes [E, N, K]: each expert's transpose
    (a per-expert scale as it is, a 128x128 grid transposed)."""
    scale_t = scale_inv if scale_inv.dim() == 1 else scale_inv.transpose(1, 2).contiguous()
    return transpose_bytes(data), scale_t


def stacked_transposed(stacked: QuantizedTensor) -> Operand:
    """The data gradient's operand of a stacked FP8 parameter, read when the backward runs
    (after the engine re-gathered it): the transpose of its rowwise bytes, or of its
    columnwise bytes when only those are present, as `ExpertWeight.create_transpose_cache`."""
    direction = "rowwise" if stacked.has_data("rowwise") else "columnwise"
    data = getattr(stacked, f"{direction}_data")
    if data is None:
        raise ValueError(f"{stacked._label()} has no bytes to transpose")
    scale_inv = getattr(stacked, f"{direction}_scale_inv")
    return transposed_experts(data.view(stacked.fp8_dtype), scale_inv)
