"""One FP8 grouped GEMM autograd function for all experts of a stacked expert weight
(FP8_NUMERICS.md, "Experts"): forward, data gradient and weight gradient of
`Fp8StackedLinear` under the per-tensor current-scaling recipe (tensorwise).

The rule is the per-segment path's (`fp8_experts.grouped_fp8_gemm`, kept as the reference the
tests compare with): one FP8 product per (expert, segment), each segment (the rows of one
expert from one source rank) quantized with its own tensorwise scale, each expert's weight with
its own; fp32 accumulation; outputs rounded as the dense Fp8Linear rounds them (forward with
fast accumulation, dgrad and wgrad without). Here every operand is quantized in ONE pass (the
segment amaxes by one scatter-reduce of row amaxes) and each GEMM kind is one call:

- CPU (and any device where the paths below do not apply): the exact emulation, one fp32 GEMM
  per segment on the dequantized operands, bitwise the per-segment path's (same operand shapes);
- CUDA, E4M3 x E4M3 with bf16 output: `torch._scaled_grouped_mm` (2d x 3d, ragged rows; the
  row scale is the segment's scale_inv, the expert's scale_inv broadcast over its columns);
- CUDA otherwise (E5M2 gradients under `hybrid`, fp32 outputs, the weight gradient): the
  Triton kernels of `fp8/cuda/grouped_gemm.py`; per-segment scales enter the ragged-M kernel
  as its 1x128 / 128x128 block scales (constant along K) and scale the ragged-K kernel's
  per-segment results (groups = segments, summed per expert afterwards).

The GEMMs are custom ops (`megatron_fp8::grouped_fp8_mm`, `::grouped_fp8_wgrad`), so that
torch.compile sees one opaque node per GEMM and no graph break. Other recipes (delayed,
blockwise, mxfp8), FP8 weight parameters and statistics steps take the per-segment path.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.cuda.grouped_gemm import grouped_scaled_mm, grouped_scaled_mm_wgrad
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.reference import (
    amax_ignoring_nan,
    reciprocal,
    saturating_cast,
    scale_from_amax,
)

E4M3 = torch.float8_e4m3fn
_TORCH_ALIGN = 16
"""torch._scaled_grouped_mm wants K and N multiples of 16 (16-byte FP8 rows)."""


def grouped_path_applies(config: Fp8Config, weight: torch.Tensor) -> bool:
    """Whether `grouped_fp8_linear` covers this call: tensorwise current scaling on a plain
    high-precision stacked weight."""
    spec = config.spec
    return spec.per_tensor and not spec.delayed and not isinstance(weight, QuantizedTensor)


def _segment_ids(sizes: list[int], device: torch.device) -> torch.Tensor:
    ids = torch.arange(len(sizes), device=device)
    counts = torch.tensor(sizes, device=device)
    return torch.repeat_interleave(ids, counts, output_size=sum(sizes))


def quantize_segments(
    x: torch.Tensor, seg_ids: torch.Tensor, num_segments: int, *, fp8_dtype, power_2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 bytes [M, K] as fp8_dtype, scale_inv [num_segments] fp32): each
    segment's rows quantized tensorwise with the scale of that segment's amax, exactly as
    `quantize` quantizes the segment alone (an empty segment gets scale 1)."""
    row_amax = amax_ignoring_nan(x, dim=-1)
    amax = torch.zeros(num_segments, dtype=torch.float32, device=x.device)
    amax = amax.scatter_reduce(0, seg_ids, row_amax, "amax", include_self=True)
    scale = scale_from_amax(amax, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    scaled = x.to(torch.float32) * scale[seg_ids][:, None]  # quantize reads x in fp32
    return saturating_cast(scaled, fp8_dtype).view(fp8_dtype), reciprocal(scale)


def quantize_experts(
    weight: torch.Tensor, *, fp8_dtype, power_2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, N, K] -> (FP8 bytes, scale_inv [E]): each expert quantized tensorwise."""
    amax = amax_ignoring_nan(weight, dim=(1, 2))
    scale = scale_from_amax(amax, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale)
    scaled = weight.to(torch.float32) * scale[:, None, None]
    return saturating_cast(scaled, fp8_dtype).view(fp8_dtype), reciprocal(scale)


def _seg_bounds(seg_sizes: list[int]) -> list[int]:
    bounds = [0]
    for size in seg_sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def _emulated_mm(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, out_dtype):
    """The CPU twin: per segment, dequantized A rows @ dequantized B[e]^T in fp32."""
    bounds = _seg_bounds(seg_sizes)
    out = a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
    for s, expert in enumerate(seg_expert):
        if seg_sizes[s] == 0:
            continue
        rows = slice(bounds[s], bounds[s + 1])
        a_values = a[rows].to(torch.float32) * a_scale_inv[s]
        b_values = b[expert].to(torch.float32) * b_scale_inv[expert]
        out[rows] = (a_values @ b_values.t()).to(out_dtype)
    return out


def _torch_mm_applies(a, b, out_dtype) -> bool:
    return (
        a.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and a.dtype == E4M3 == b.dtype
        and out_dtype == torch.bfloat16
        and a.shape[1] % _TORCH_ALIGN == 0
        and b.shape[1] % _TORCH_ALIGN == 0
    )


def _expert_sizes(seg_sizes, seg_expert, num_experts) -> list[int]:
    sizes = [0] * num_experts
    for size, expert in zip(seg_sizes, seg_expert):
        sizes[expert] += size
    return sizes


def _cuda_mm(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, out_dtype, fast_accum):
    """Segments are sorted by expert (the dispatcher's order): experts are the groups."""
    seg_ids = _segment_ids(seg_sizes, a.device)
    row_scale = a_scale_inv[seg_ids]
    groups, n, k = b.shape
    sizes = _expert_sizes(seg_sizes, seg_expert, groups)
    if _torch_mm_applies(a, b, out_dtype):
        offsets = torch.tensor(sizes, device=a.device).cumsum(0).to(torch.int32)
        return torch._scaled_grouped_mm(
            a,
            b.transpose(1, 2),
            row_scale.contiguous(),
            b_scale_inv[:, None].expand(groups, n).contiguous(),
            offs=offsets,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    # The Triton ragged-M kernel: scales constant along K, given as its block scales.
    k_blocks, n_blocks = -(-k // 128), -(-n // 128)
    return grouped_scaled_mm(
        a,
        b,
        a_scale_inv=row_scale[:, None].expand(a.shape[0], k_blocks).contiguous(),
        b_scale_inv=b_scale_inv[:, None, None].expand(groups, n_blocks, k_blocks).contiguous(),
        group_sizes=sizes,
        recipe="blockwise",
        out_dtype=out_dtype,
    )


@torch.library.custom_op("megatron_fp8::grouped_fp8_mm", mutates_args=())
def grouped_fp8_mm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    seg_sizes: list[int],
    seg_expert: list[int],
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """A [M, K] FP8 (rows in segments, scale_inv [S]) times B [E, N, K] FP8 (scale_inv [E]):
    rows of segment s @ B[seg_expert[s]]^T -> [M, N] in out_dtype."""
    args = (a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, out_dtype)
    if a.is_cuda and a.shape[0] > 0:
        return _cuda_mm(*args, fast_accum).contiguous()
    return _emulated_mm(*args)


@grouped_fp8_mm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _emulated_wgrad(dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, out):
    """Per segment: (dy_s^T dequantized) @ (x_s^T dequantized)^T in fp32, rounded to out's
    dtype, summed into its expert last segment first (the per-segment path's operand shapes and
    the order its backward sums them in)."""
    bounds = _seg_bounds(seg_sizes)
    for s, expert in reversed(list(enumerate(seg_expert))):
        if seg_sizes[s] == 0:
            continue
        rows = slice(bounds[s], bounds[s + 1])
        dy_t = dy[rows].t().contiguous().to(torch.float32) * dy_scale_inv[s]
        x_t = x[rows].t().contiguous().to(torch.float32) * x_scale_inv[s]
        out[expert] += (dy_t @ x_t.t()).to(out.dtype)
    return out


def _cuda_wgrad(dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, out):
    """The Triton ragged-K kernel with groups = segments and unit scales, each segment's
    [N, K] result then scaled by its two scale_invs and summed into its expert."""
    one = torch.ones((), dtype=torch.float32, device=dy.device)
    per_segment = grouped_scaled_mm_wgrad(
        dy.t().contiguous(),
        x.t().contiguous(),
        a_scale_inv=one,
        b_scale_inv=one,
        group_sizes=list(seg_sizes),
        recipe="tensorwise",
        out_dtype=torch.float32,
    )
    per_segment = per_segment * (dy_scale_inv * x_scale_inv)[:, None, None]
    index = torch.tensor(seg_expert, dtype=torch.long, device=dy.device)
    summed = torch.zeros(out.shape, dtype=torch.float32, device=dy.device)
    return out.copy_(summed.index_add_(0, index, per_segment))


@torch.library.custom_op("megatron_fp8::grouped_fp8_wgrad", mutates_args=())
def grouped_fp8_wgrad(
    dy: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    seg_sizes: list[int],
    seg_expert: list[int],
    num_experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW [E, N, K] in out_dtype: dW[e] = sum over e's segments s of dy_s^T x_s (FP8 dy [M, N]
    and x [M, K], scale_inv [S] each); experts with no rows get zeros."""
    out = dy.new_zeros((num_experts, dy.shape[1], x.shape[1]), dtype=out_dtype)
    args = (dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, out)
    if dy.is_cuda and dy.shape[0] > 0:
        return _cuda_wgrad(*args)
    return _emulated_wgrad(*args)


@grouped_fp8_wgrad.register_fake
def _(dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, num_experts, out_dtype):
    return dy.new_empty((num_experts, dy.shape[1], x.shape[1]), dtype=out_dtype)


class _GroupedFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, seg_sizes, seg_expert, config):  # noqa: D102
        pow2 = config.spec.resolve_power_2_scale(config.quantize_power_2_scale)
        seg_ids = _segment_ids(seg_sizes, tokens.device)
        x_q, x_s = quantize_segments(
            tokens,
            seg_ids,
            len(seg_sizes),
            fp8_dtype=fp8_dtype_for_role(config.fp8_format, "input"),
            power_2_scale=pow2,
        )
        w_q, w_s = quantize_experts(
            weight.detach(),
            fp8_dtype=fp8_dtype_for_role(config.fp8_format, "weight"),
            power_2_scale=pow2,
        )
        ctx.save_for_backward(x_q, x_s, w_q, w_s, seg_ids)
        ctx.layout = (seg_sizes, seg_expert)
        ctx.config, ctx.pow2, ctx.dtypes = config, pow2, (tokens.dtype, weight.dtype)
        fast = config.spec.fast_accumulation
        return grouped_fp8_mm(x_q, x_s, w_q, w_s, seg_sizes, seg_expert, tokens.dtype, fast)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x_q, x_s, w_q, w_s, seg_ids = ctx.saved_tensors
        seg_sizes, seg_expert = ctx.layout
        grad_dtype = fp8_dtype_for_role(ctx.config.fp8_format, "grad")
        dy_q, dy_s = quantize_segments(
            dy.contiguous(), seg_ids, len(seg_sizes), fp8_dtype=grad_dtype, power_2_scale=ctx.pow2
        )
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t = w_q.transpose(1, 2).contiguous()  # [E, in, out]: dgrad's B
            dx = grouped_fp8_mm(dy_q, dy_s, w_t, w_s, seg_sizes, seg_expert, ctx.dtypes[0], False)
        if ctx.needs_input_grad[1]:
            experts = w_q.shape[0]
            dw = grouped_fp8_wgrad(
                dy_q, dy_s, x_q, x_s, seg_sizes, seg_expert, experts, ctx.dtypes[1]
            )
        return dx, dw, None, None, None


def grouped_fp8_linear(
    tokens: torch.Tensor, weight: torch.Tensor, segments: list[list[int]], config: Fp8Config
) -> torch.Tensor:
    """y[rows of expert e] = tokens[rows of e] @ weight[e]^T in FP8, all experts in one
    autograd function; segments[e]: expert e's row counts per source rank (in token order)."""
    seg_sizes = [count for counts in segments for count in counts]
    seg_expert = [expert for expert, counts in enumerate(segments) for _ in counts]
    return _GroupedFp8Function.apply(tokens, weight, seg_sizes, seg_expert, config)
