"""One FP8 grouped GEMM autograd function for all experts of a stacked expert weight
(FP8_NUMERICS.md, "Experts"): forward, data gradient and weight gradient of
`Fp8StackedLinear` under the current-scaling recipes tensorwise and blockwise, on a
high-precision stacked weight or on an FP8 parameter of Megatron-FSDP.

The rule is the per-segment path's (`fp8_experts.grouped_fp8_gemm`, kept as the reference the
tests compare with): one FP8 product per (expert, segment), each segment (the rows of one
expert from one source rank) quantized as a Linear's input alone, each expert's weight as a
Linear weight (or its FP8 parameter's bytes and scales read as they are); fp32 accumulation;
outputs rounded as the dense Fp8Linear rounds them (forward with fast accumulation under
tensorwise, everything else without). Here every operand is quantized in ONE pass
(`grouped_operands.py`) and each GEMM kind is one call:

- CPU (and any device where the paths below do not apply): the exact emulation, one fp32 GEMM
  per segment on the dequantized operands, bitwise the per-segment path's (same operand
  shapes, the same `Fp8Operand.dequantize`);
- CUDA, tensorwise E4M3 x E4M3 with bf16 output: `torch._scaled_grouped_mm` (2d x 3d, ragged
  rows; the row scale is the segment's scale_inv, the expert's broadcast over its columns);
- CUDA otherwise: the Triton kernels of `fp8/cuda/grouped_gemm.py`. Forward and data gradient:
  the ragged-M kernel (blockwise: its 1x128 / 128x128 scales as they are; tensorwise: each
  row's segment scale and each expert's, applied once to the fp32 sum, fast accumulation in
  the forward as torch's). Weight gradient: the ragged-K
  kernel, blockwise with groups = experts (per (row, 128-token chunk) scales, chunks counted
  from each segment's start, on the padded transposed copies: dW written by the kernel in the
  weight's dtype), tensorwise with groups = experts, each expert's segments (at EP > 1
  several) summed in the kernel with their own scales.

The GEMMs are custom ops (`megatron_fp8::grouped_fp8_mm`, `::grouped_fp8_wgrad`, and
`::grouped_fp8_weight_mm` for an FP8 parameter's stand-in), so that torch.compile sees one
opaque node per GEMM and no graph break (an FP8 parameter enters a compiled graph as the
stand-in `fp8.compile` makes for it; the op reads the parameter when it runs). Gradient
accumulation fusion (an FP8 parameter with a main_grad_sink, fp8/main_grad.py): the weight
gradient is written into the engine's grad buffer (fp32, or the buffer's bf16) and autograd
gets none; compiled, dgrad and that write are one op, `::grouped_fp8_weight_backward`.
delayed runs as tensorwise with each segment at its expert's delayed scale
(`fp8_experts.DelayedExperts`: the scales of each role, and every expert's amaxes recorded),
eagerly and on counts read on the host (its state is Python).
mxfp8 (emulated: no MXFP8 GEMM before Blackwell) goes to `grouped_mxfp8.grouped_mxfp8_linear`,
the same rule on dequantized values, also eagerly and on host counts. `grouped_path_applies` is
the one rule of which path runs.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.compile import stand_in_owner
from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.cuda.grouped_gemm import BLOCK_K as TOKEN_TILE
from megatron.core.fp8.cuda.grouped_gemm import (
    group_offsets,
    grouped_scaled_mm,
    grouped_scaled_mm_wgrad,
    tile_schedule,
)
from megatron.core.fp8.cuda.launch import aligned_16
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.main_grad import fuse_into_main_grad, has_main_grad_sink
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.moe import grouped_emulation as emulation
from megatron.core.transformer.moe import grouped_mxfp8
from megatron.core.transformer.moe import grouped_operands as operands

E4M3 = torch.float8_e4m3fn
_TORCH_ALIGN = 16
"""torch._scaled_grouped_mm wants K and N multiples of 16 (16-byte FP8 rows) and operands that
start at 16-byte aligned addresses (an FP8 parameter's bytes are a view into the engine's
buffer, packed without gaps: not always aligned; the Triton kernel takes any address)."""


def grouped_path_applies(config: Fp8Config, weight: torch.Tensor) -> bool:
    """Whether `grouped_fp8_linear` covers this call: a recipe with fp32 scales (tensorwise,
    delayed, blockwise) on a stacked [E, out, in] weight, high precision or FP8 parameter (its
    recipe checked by the caller); mxfp8 through `grouped_mxfp8` where each expert's cells
    are its own (`grouped_mxfp8.applies`), else the per-segment path."""
    if config.spec.e8m0_scales:
        return grouped_mxfp8.applies(config.spec, weight)
    return weight.dim() == 3


def _torch_mm_applies(a, b, recipe, out_dtype) -> bool:
    return (
        a.is_cuda
        and recipe_spec(recipe).per_tensor
        and hasattr(torch, "_scaled_grouped_mm")
        and a.dtype == E4M3 == b.dtype
        and out_dtype == torch.bfloat16
        and a.shape[1] % _TORCH_ALIGN == 0
        and b.shape[1] % _TORCH_ALIGN == 0
        and aligned_16(a)
        and aligned_16(b)
    )


def _one_segment_each(seg_expert: list[int], num_experts: int) -> bool:
    """One segment per expert, in expert order (expert parallelism 1)."""
    return list(seg_expert) == list(range(num_experts))


def _expert_sizes(seg_sizes, seg_expert, num_experts) -> torch.Tensor:
    """Rows per expert (on the device) of rows per segment."""
    if _one_segment_each(seg_expert, num_experts):
        return seg_sizes
    index = torch.tensor(seg_expert, dtype=torch.long, device=seg_sizes.device)
    return seg_sizes.new_zeros(num_experts).index_add_(0, index, seg_sizes)


def _padded_segment_rows(seg_sizes: torch.Tensor) -> torch.Tensor:
    """Each segment's rows in the weight gradient's padded copy: whole TOKEN_TILE-row tiles."""
    return TOKEN_TILE * ((seg_sizes + TOKEN_TILE - 1) // TOKEN_TILE)


ROUTING = 10
"""Tensors `routing` gives; where each is in its list:"""
SEG_IDS, SIZES, SCHEDULE, POSITION, SOURCE, PADDED_SIZES = 0, 1, slice(2, 5), 5, 6, 7
PADDED_OFFSETS = slice(8, 10)


def routing(seg_sizes, seg_expert, experts: int, rows: int, padded: int) -> list[torch.Tensor]:
    """What the grouped GEMMs of one layer call derive from its segments (sorted by expert),
    built once (in the compiled graph, where they fuse) instead of in each GEMM: each row's
    segment, the rows per expert, the ragged-M kernel's tile schedule over the experts (tile
    group, tile row, the experts' end rows as int32, also torch's grouped GEMM offsets), each
    row's row in the padded copy of `padded` rows and the row each of those holds (-1:
    padding), the padded copy's rows per expert and their `group_offsets` (weight gradient)."""
    seg_ids = operands.segment_ids(seg_sizes, rows)
    sizes = _expert_sizes(seg_sizes, seg_expert, experts)
    position = operands.padded_positions(seg_ids, seg_sizes, TOKEN_TILE)
    source = operands.padded_sources(position, padded)
    padded_sizes = _expert_sizes(_padded_segment_rows(seg_sizes), seg_expert, experts)
    schedule = tile_schedule(sizes, rows)
    return [seg_ids, sizes, *schedule, position, source, padded_sizes, *group_offsets(padded_sizes)]


def _routing_of(seg_sizes, seg_expert, experts, rows, r, padded=0) -> list[torch.Tensor]:
    """r when given, else `routing` built here (padded: the padded copy's rows; 0: as many
    as any sizes need)."""
    if r:
        return r
    padded = padded or operands.padded_rows(seg_sizes, rows, TOKEN_TILE)
    return routing(seg_sizes, seg_expert, experts, rows, padded)


def _cuda_mm(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, recipe, out_dtype, fast, r=()):
    """Segments are sorted by expert (the dispatcher's order): experts are the groups. r:
    `routing` of these segments (built here when not given)."""
    groups, n, k = b.shape
    r = _routing_of(seg_sizes, seg_expert, groups, a.shape[0], r)
    schedule = tuple(r[SCHEDULE])
    options = dict(group_sizes=r[SIZES], out_dtype=out_dtype, schedule=schedule)
    if not recipe_spec(recipe).per_tensor:  # blockwise: 1x128 rows, 128x128 experts
        scales = dict(a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv.contiguous())
        return grouped_scaled_mm(a, b, **scales, recipe=recipe, **options)
    # Per tensor: one A scale_inv per row, its segment's (gathered in `_quantize_tokens`).
    if _torch_mm_applies(a, b, recipe, out_dtype):
        return torch._scaled_grouped_mm(
            a,
            b.transpose(1, 2),
            a_scale_inv.contiguous(),
            b_scale_inv[:, None].expand(groups, n).contiguous(),
            offs=schedule[-1],  # the experts' end rows
            out_dtype=out_dtype,
            use_fast_accum=fast,
        )
    # The Triton ragged-M kernel: each row's segment scale and each expert's, applied once
    # to the fp32 sum (constant along K).
    scales = dict(a_scale_inv=a_scale_inv.contiguous(), b_scale_inv=b_scale_inv.contiguous())
    return grouped_scaled_mm(a, b, **scales, recipe=recipe, fast_accum=fast, **options)


@torch.library.custom_op("megatron_fp8::grouped_fp8_mm", mutates_args=())
def grouped_fp8_mm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    seg_sizes: torch.Tensor,
    seg_expert: list[int],
    recipe: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    r: list[torch.Tensor],
) -> torch.Tensor:
    """A [M, K] FP8 (rows in segments of seg_sizes [S] rows, a device tensor) times B [E, N,
    K] FP8: rows of segment s @ B[seg_expert[s]]^T -> [M, N] in out_dtype. scale_inv of A:
    per tensor [M] (each row's segment's), blockwise [M, ceil(K/128)]; of B: [E], or [E,
    ceil(N/128), ceil(K/128)]. r: `routing` of the segments, or [] (built when needed)."""
    layout = (seg_sizes, seg_expert, recipe, out_dtype, fast_accum, r)
    return _grouped_mm(a, a_scale_inv, b, b_scale_inv, *layout)


def _grouped_mm(
    a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, recipe, out_dtype, fast_accum, r
):
    """`grouped_fp8_mm`'s body (also run inside `grouped_fp8_weight_mm`, without a second
    custom-op dispatch)."""
    args = (a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, recipe, out_dtype)
    if a.is_cuda and a.shape[0] > 0:
        return _cuda_mm(*args, fast_accum, r).contiguous()
    return emulation.emulated_mm(*args)


@grouped_fp8_mm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, recipe, out_dtype, fast_accum, r):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _cuda_wgrad(
    dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, recipe, shape, dtype, padded, r=(),
    out=None, accumulate=False,
):  # fmt: skip
    """The Triton ragged-K kernel -> dW `shape` in `dtype`, written by the kernel at any EP
    size, on token-major copies with each segment padded to whole 128-token tiles (zeros add
    nothing; the kernel's loads are unmasked and aligned). Per tensor: the rowwise bytes
    transposed into that layout, groups = experts (one segment each, EP 1) or experts of
    several segments, each with its scale_inv pair ([S] each), summed in the kernel.
    Blockwise: the padded transposed copies as they are, groups = experts (each 128-token
    cell's product is scaled before it is added; an expert's padded segments are
    consecutive whole cells). padded: the rows of the padded copies; r: `routing`; out: where
    the kernel writes dW (else a new tensor), with `accumulate` adding it to out's values."""
    spec = recipe_spec(recipe)
    experts = shape[0]
    options = dict(a_scale_inv=dy_scale_inv, b_scale_inv=x_scale_inv, recipe=recipe)
    options.update(out_dtype=dtype, whole_tiles=True, out=out, accumulate=accumulate)
    if not spec.per_tensor:  # the padded copies as they are: whole tiles of each expert
        if r:
            options.update(group_sizes=r[PADDED_SIZES], offsets=tuple(r[PADDED_OFFSETS]))
        else:
            sizes = _expert_sizes(_padded_segment_rows(seg_sizes), seg_expert, experts)
            options.update(group_sizes=sizes)
        return grouped_scaled_mm_wgrad(dy, x, **options)
    r = _routing_of(seg_sizes, seg_expert, experts, dy.shape[0], r, padded)  # dy [M, N]
    dy, x = (operands.padded_transpose(t, r[SOURCE]) for t in (dy, x))  # rowwise bytes [M, *]
    if _one_segment_each(seg_expert, experts):  # groups of whole tiles: the experts'
        options.update(group_sizes=r[PADDED_SIZES], offsets=tuple(r[PADDED_OFFSETS]))
    else:  # each expert's segments (expert parallelism), summed in the kernel
        options.update(group_sizes=_padded_segment_rows(seg_sizes), segment_group=list(seg_expert))
    return grouped_scaled_mm_wgrad(dy, x, **options)


@torch.library.custom_op("megatron_fp8::grouped_fp8_wgrad", mutates_args=())
def grouped_fp8_wgrad(
    dy: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    seg_sizes: torch.Tensor,
    seg_expert: list[int],
    num_experts: int,
    recipe: str,
    out_dtype: torch.dtype,
    padded: int,
    r: list[torch.Tensor],
) -> torch.Tensor:
    """dW [E, N, K] in out_dtype: dW[e] = sum over e's segments s of dy_s^T x_s. Per tensor:
    the rowwise bytes dy [M, N], x [M, K] with scale_inv [S]; blockwise: the transposed
    columnwise copies dy [N, P], x [K, P] (`grouped_operands.quantize_segment_operands`:
    segments padded to whole 128-token cells) with scale_inv [N, P / 128] / [K, P / 128].
    padded: P, the rows of the padded copies (`grouped_operands.padded_rows`); r: `routing`, or
    [] (built when needed). Experts with no rows get zeros."""
    args = (seg_sizes, seg_expert, num_experts, recipe, out_dtype, padded, r)
    return _wgrad(dy, dy_scale_inv, x, x_scale_inv, *args)


def _wgrad(
    dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, num_experts, recipe, out_dtype,
    padded, r, out=None, accumulate=False,
):  # fmt: skip
    """`grouped_fp8_wgrad`'s body; out: a contiguous [E, N, K] tensor of out_dtype that dW is
    written into (overwritten, or with `accumulate` added to: out + the fp32 dW, rounded
    once), else a new one."""
    n, k = _wgrad_dims(dy, x, recipe)
    shape = (num_experts, n, k)
    args = (dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, recipe)
    if dy.is_cuda and dy.numel() > 0:
        if out_dtype == torch.float64:  # the kernel sums an expert's segments in fp32
            out_dtype = torch.float32
        return _cuda_wgrad(*args, shape, out_dtype, padded, r, out=out, accumulate=accumulate)
    if out is None:  # each segment's fp32 product rounded to out_dtype and summed there
        return emulation.emulated_wgrad(*args, dy.new_zeros(shape, dtype=out_dtype))
    # Into a buffer: the segments summed in fp32 and rounded once, as the kernel does (a new
    # dW of a bf16 weight instead rounds each segment, as the per-segment path's autograd).
    product = emulation.emulated_wgrad(*args, dy.new_zeros(shape, dtype=torch.float32))
    return out.add_(product) if accumulate else out.copy_(product)


def _write_main_grad(weight: QuantizedTensor, dy_col, x_col, args: tuple) -> None:
    """Gradient accumulation fusion (fp8/main_grad.py) for a stacked FP8 expert weight: dW
    written into its main_grad_sink's slot by the wgrad kernel itself (fp32, or the buffer's
    bf16), a later micro-batch's fp32 product added there by the kernel too (it reads the slot
    in its epilogue: no dW tensor, no second pass). args: (seg_sizes, seg_expert, experts,
    recipe, padded, r)."""
    seg_sizes, seg_expert, experts, recipe, padded, r = args
    operands_ = (*dy_col, *x_col, seg_sizes, seg_expert, experts, recipe)

    def write_into(target: torch.Tensor, accumulate: bool) -> bool:
        _wgrad(*operands_, target.dtype, padded, r, out=target, accumulate=accumulate)
        return True

    fuse_into_main_grad(weight, write_into, lambda dtype: _wgrad(*operands_, dtype, padded, r))


def _wgrad_dims(dy, x, recipe) -> tuple[int, int]:
    """(N, K) of the weight gradient from its operands' layouts (module docstring)."""
    if recipe_spec(recipe).per_tensor:
        return dy.shape[1], x.shape[1]
    return dy.shape[0], x.shape[0]


@grouped_fp8_wgrad.register_fake
def _(dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, num_experts, recipe, out_dtype, *_):
    return dy.new_empty((num_experts, *_wgrad_dims(dy, x, recipe)), dtype=out_dtype)


def _stacked_operand(stacked: QuantizedTensor, usage: str) -> operands.Operand:
    """An FP8 parameter's operand: "rowwise" (forward) or "columnwise" (dgrad's transpose)."""
    if usage == "rowwise":
        return operands.stacked_operand(stacked)
    return operands.stacked_transposed(stacked)


@torch.library.custom_op("megatron_fp8::grouped_fp8_weight_mm", mutates_args=())
def grouped_fp8_weight_mm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    stand_in: torch.Tensor,
    usage: str,
    seg_sizes: torch.Tensor,
    seg_expert: list[int],
    recipe: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    r: list[torch.Tensor],
) -> torch.Tensor:
    """`grouped_fp8_mm` with B the stacked FP8 parameter that `stand_in` stands for in a
    compiled graph (`fp8.compile`'s stand-ins): its bytes and scales read when the op runs,
    after the engine gathered them ("rowwise": W, "columnwise": each expert's transpose)."""
    b = _stacked_operand(_owner_weight(stand_in), usage)
    args = (seg_sizes, seg_expert, recipe, out_dtype, fast_accum, r)
    return _grouped_mm(a, a_scale_inv, *b, *args)


def _owner_weight(stand_in: torch.Tensor) -> QuantizedTensor:
    """The stacked FP8 parameter that `stand_in` stands for (its Fp8StackedLinear's)."""
    owner = stand_in_owner(stand_in)
    if owner is None or not isinstance(owner.weight, QuantizedTensor):
        raise RuntimeError(
            "an FP8 expert weight stand-in reached a megatron_fp8 grouped op without its "
            "Fp8StackedLinear; call prepare_for_compile(module) on the compiled module"
        )
    return owner.weight


@grouped_fp8_weight_mm.register_fake
def _(a, a_scale_inv, stand_in, usage, seg_sizes, seg_expert, recipe, out_dtype, fast_accum, r):
    columns = stand_in.shape[1] if usage == "rowwise" else stand_in.shape[2]
    return a.new_empty((a.shape[0], columns), dtype=out_dtype)


@torch.library.custom_op("megatron_fp8::grouped_fp8_weight_backward", mutates_args=())
def grouped_fp8_weight_backward(
    tensors: list[torch.Tensor],
    stand_in: torch.Tensor,
    seg_sizes: torch.Tensor,
    seg_expert: list[int],
    recipe: str,
    dx_dtype: torch.dtype,
    padded: int,
    r: list[torch.Tensor],
) -> torch.Tensor:
    """A compiled graph's backward of an FP8 expert parameter under gradient accumulation
    fusion: the data gradient (returned) and the weight gradient written into the parameter's
    main_grad_sink, one op whose output is dx so that the graph keeps it. tensors:
    `_backward_tensors` of dy's rows, dy's weight-gradient operand and x's."""
    weight = _owner_weight(stand_in)
    dy_row, dy_col, x_col = _backward_operands(tensors, recipe)
    w_t = _stacked_operand(weight, "columnwise")
    dx = _grouped_mm(*dy_row, *w_t, seg_sizes, seg_expert, recipe, dx_dtype, False, r)
    del w_t  # freed before the wgrad write, as in the unfused backward
    args = (seg_sizes, seg_expert, weight.shape[0], recipe, padded, r)
    _write_main_grad(weight, dy_col, x_col, args)
    return dx


def _backward_tensors(dy_row, dy_col, x_col, recipe: str) -> list[torch.Tensor]:
    """The fused backward op's tensor list: each tensor once. Per tensor, dy's rows and its
    weight-gradient operand share their bytes: [bytes, row scale_inv, segment scale_inv, x's
    two] (listed twice, Inductor fed the op two buffers of the same bytes, 1 byte per element
    of dy more at the peak); blockwise, the six (data, scale_inv) fields."""
    if recipe_spec(recipe).per_tensor:
        if dy_col[0] is not dy_row[0]:
            raise ValueError("per tensor, dy's rows and its wgrad operand share their bytes")
        return [dy_row[0], dy_row[1], dy_col[1], *x_col]
    return [*dy_row, *dy_col, *x_col]


def _backward_operands(tensors: list[torch.Tensor], recipe: str) -> tuple[tuple, tuple, tuple]:
    """`_backward_tensors` undone: (dy's rows, dy's weight-gradient operand, x's)."""
    per_tensor = recipe_spec(recipe).per_tensor
    if len(tensors) != (5 if per_tensor else 6):
        raise ValueError(f"{recipe}: the fused backward takes 5 or 6 tensors, got {len(tensors)}")
    if per_tensor:
        return (tensors[0], tensors[1]), (tensors[0], tensors[2]), (tensors[3], tensors[4])
    return (tensors[0], tensors[1]), (tensors[2], tensors[3]), (tensors[4], tensors[5])


@grouped_fp8_weight_backward.register_fake
def _(tensors, stand_in, seg_sizes, seg_expert, recipe, dx_dtype, padded, r):
    return tensors[0].new_empty((tensors[0].shape[0], stand_in.shape[2]), dtype=dx_dtype)


def _weight_mm(a_op, weight, kind: str, usage: str, args: tuple) -> torch.Tensor:
    """a_op times the weight's operand for `usage` ("rowwise": forward, "columnwise": dgrad).
    kind "plain": weight is the quantized rowwise (bytes, scale_inv); "fp8_param": the stacked
    QuantizedTensor; "stand_in": its stand-in in a compiled graph."""
    if kind == "stand_in":
        return grouped_fp8_weight_mm(*a_op, weight, usage, *args)
    if kind == "fp8_param":
        b = _stacked_operand(weight, usage)
    else:
        b = weight if usage == "rowwise" else operands.transposed_experts(*weight)
    return grouped_fp8_mm(*a_op, *b, *args)


def _quantize_tokens(t, r, seg_sizes, config, role, pow2, *, columnwise: int, delayed=None):
    """(rowwise operand, the weight gradient's operand or None) of tokens [M, *] in `role`
    ("input" or "grad"); per tensor both are the segments' rowwise bytes, with each row's
    segment's scale_inv ([M], gathered here, in the compiled graph) and the segments' ([S]).
    r: `routing` of the segments; columnwise: the padded copy's rows (blockwise), 0 for none;
    delayed: delayed scaling's state of the call (`grouped_fp8_linear`)."""
    seg_ids = r[SEG_IDS]
    spec, fp8_dtype = config.spec, fp8_dtype_for_role(config.fp8_format, role)
    if spec.per_tensor:
        tiles = (r[SOURCE], TOKEN_TILE)  # the segments' amaxes reduced per tile first
        if delayed is not None:
            scale = delayed.segment_scales(role)
            options = dict(fp8_dtype=fp8_dtype, tiles=tiles)
            (data, scale_inv), amax = operands.quantize_segments_at(t, seg_ids, scale, **options)
            delayed.record(role, amax)
        else:
            data, scale_inv = operands.quantize_segments(
                t, seg_ids, seg_sizes.shape[0], fp8_dtype=fp8_dtype, power_2_scale=pow2, tiles=tiles
            )
        return (data, scale_inv[seg_ids]), (data, scale_inv)
    options = dict(spec=spec, role=role, fp8_dtype=fp8_dtype, power_2_scale=pow2)
    if not columnwise:
        return operands.quantize_rows(t, **options), None
    # routing's positions are in TOKEN_TILE-row cells, blockwise's 128 (the tile is the cell:
    # test_grouped_gemm.py::test_the_token_tile_is_the_blockwise_cell)
    return operands.quantize_segment_operands(
        t, seg_ids, seg_sizes, length=columnwise, position=r[POSITION], **options
    )


class _GroupedFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, seg_sizes, layout, config, kind):  # noqa: D102
        spec = config.spec
        pow2 = spec.resolve_power_2_scale(config.quantize_power_2_scale)
        seg_expert, padded, ctx.fused_wgrad, ctx.delayed = layout
        r = routing(seg_sizes, seg_expert, weight.shape[0], tokens.shape[0], padded)
        columnwise = padded if weight.requires_grad else 0
        x_row, x_col = _quantize_tokens(
            tokens, r, seg_sizes, config, "input", pow2, columnwise=columnwise, delayed=ctx.delayed
        )
        # An FP8 parameter is re-read in backward (after the engine gathered it again), as
        # `ExpertWeight` reads it; its stand-in is saved, a plain weight's quantized bytes.
        ctx.stacked = weight if kind == "fp8_param" else None
        source = weight
        if kind == "plain":
            w_dtype = fp8_dtype_for_role(config.fp8_format, "weight")
            scale = None if ctx.delayed is None else ctx.delayed.scales["weight"]
            source = operands.quantize_experts(
                weight.detach(), spec=spec, fp8_dtype=w_dtype, power_2_scale=pow2, scale=scale
            )
            if ctx.delayed is not None:
                ctx.delayed.record_experts("weight", operands.expert_amax(weight.detach()))
        saved_weight = {"plain": source, "stand_in": (weight,), "fp8_param": ()}[kind]
        ctx.save_for_backward(seg_sizes, *r, *(x_col or ()), *saved_weight)
        ctx.x_saved, ctx.kind = 0 if x_col is None else 2, kind
        ctx.layout = (seg_expert, weight.shape[0], padded)
        ctx.config, ctx.pow2, ctx.dtypes = config, pow2, (tokens.dtype, weight.dtype)
        args = (seg_sizes, seg_expert, spec.name, tokens.dtype, spec.fast_accumulation, r)
        return _weight_mm(x_row, source, kind, "rowwise", args)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        seg_sizes, *saved = ctx.saved_tensors
        r, saved = saved[:ROUTING], saved[ROUTING:]
        seg_expert, experts, padded = ctx.layout
        spec = ctx.config.spec
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        columnwise = padded if need_wgrad else 0
        dy_row, dy_col = _quantize_tokens(
            dy.contiguous(), r, seg_sizes, ctx.config, "grad", ctx.pow2, columnwise=columnwise,
            delayed=ctx.delayed,
        )  # fmt: skip
        x_col, saved_weight = saved[: ctx.x_saved], saved[ctx.x_saved :]
        # Gradient accumulation fusion: dW into the engine's buffer, autograd gets none (a
        # stand-in's through one op with dgrad, which must then be needed: fp8/main_grad.py).
        fused = need_wgrad and ctx.fused_wgrad and (need_dgrad or ctx.kind != "stand_in")
        source = ctx.stacked  # fp8_param
        if ctx.kind != "fp8_param":
            source = saved_weight[0] if ctx.kind == "stand_in" else tuple(saved_weight)
        dx = dw = None
        if fused and ctx.kind == "stand_in":
            tensors = _backward_tensors(dy_row, dy_col, x_col, spec.name)
            dx = grouped_fp8_weight_backward(
                tensors, source, seg_sizes, seg_expert, spec.name, ctx.dtypes[0], padded, r
            )
        elif need_dgrad:
            args = (seg_sizes, seg_expert, spec.name, ctx.dtypes[0], False, r)
            dx = _weight_mm(dy_row, source, ctx.kind, "columnwise", args)
        if fused and ctx.kind == "fp8_param":
            args = (seg_sizes, seg_expert, experts, spec.name, padded, r)
            _write_main_grad(ctx.stacked, dy_col, x_col, args)
        elif need_wgrad and not fused:
            args = (seg_sizes, seg_expert, experts, spec.name, ctx.dtypes[1], padded, r)
            dw = grouped_fp8_wgrad(*dy_col, *x_col, *args)
        ctx.stacked = ctx.delayed = None
        return dx, dw, None, None, None, None


def grouped_fp8_linear(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    segments: list[list[int]] | torch.Tensor,
    config: Fp8Config,
    *,
    stand_in: bool = False,
    fused_wgrad: bool = False,
    delayed=None,
) -> torch.Tensor:
    """y[rows of expert e] = tokens[rows of e] @ weight[e]^T in FP8, all experts in one
    autograd function; segments[e]: expert e's row counts per source rank (in token order),
    or an integer tensor of rows per expert on the tokens' device (one segment each: read
    there, no host sync); weight: the stacked [E, out, in] parameter, high precision or a
    QuantizedTensor, or (with `stand_in`) an FP8 parameter's stand-in in a compiled graph.
    An FP8 parameter with a main_grad_sink gets its dW written there (gradient accumulation
    fusion); a stand-in's owner says so through `fused_wgrad` (a graph cannot look it up).
    delayed (recipe delayed, segments on the host, run eagerly): the experts' scaling state for
    this call, `fp8_experts.DelayedExperts` (each role's scales, and where amaxes go).
    mxfp8 (segments on the host, run eagerly): `grouped_mxfp8.grouped_mxfp8_linear`."""
    if config.spec.e8m0_scales:  # eager, on the weight itself (no stand-in, no fusion flag)
        if stand_in or delayed is not None:
            raise ValueError("mxfp8's grouped call takes neither a stand-in nor delayed state")
        return grouped_mxfp8.grouped_mxfp8_linear(tokens, weight, segments, config)
    rows = tokens.shape[0]
    if isinstance(segments, torch.Tensor):
        seg_sizes = segments.to(device=tokens.device, dtype=torch.int64)
        seg_expert = list(range(segments.shape[0]))
        # Read on the device: checked there (no host sync); they must sum to the tokens.
        torch._assert_async(seg_sizes.sum() == rows, "token counts do not sum to the tokens")
        padded = operands.padded_rows(seg_sizes, rows, TOKEN_TILE)
    else:
        flat = [count for counts in segments for count in counts]
        seg_sizes = torch.tensor(flat, dtype=torch.int64, device=tokens.device)
        seg_expert = [expert for expert, counts in enumerate(segments) for _ in counts]
        padded = operands.padded_rows(flat, rows, TOKEN_TILE)  # exact: known on the host
    kind = "stand_in" if stand_in else "plain"
    if not stand_in and isinstance(weight, QuantizedTensor):
        kind = "fp8_param"
        fused_wgrad = has_main_grad_sink(weight)
    layout = (seg_expert, padded, fused_wgrad and kind != "plain", delayed)
    return _GroupedFp8Function.apply(tokens, weight, seg_sizes, layout, config, kind)
