"""The experts' GEMMs under mxfp8 in one autograd function (FP8_NUMERICS.md, "Experts").

No GPU before Blackwell multiplies MXFP8 bytes, so the dense Fp8Linear emulates the recipe:
each operand quantized (1x32 cells along the contracted dim, 32x1 cells for a columnwise copy,
E8M0 scales) and its exact dequantized values multiplied in the backend's compute dtype with
fp32 accumulation (bf16 on CUDA, where the values are exact; fp32 on the CPU reference). The
per-segment path (`fp8_experts.grouped_fp8_gemm`) runs that once per (expert, segment). Here
every operand of all experts is quantized in ONE pass with the dense backend's quantizers and
each GEMM kind is one call:

- forward: tokens and weight rowwise (a 1x32 cell never crosses a row, so all rows at once
  give each segment's and each expert's values);
- data gradient: the output gradient rowwise, the weight columnwise: 32x1 cells along each
  expert's output rows, which never cross two experts when the output dim is a multiple of 32
  (`applies`; other shapes keep the per-segment path);
- weight gradient: the output gradient and the input columnwise, 32x1 cells along the tokens
  counted from each SEGMENT's first row: each segment zero-padded to whole cells in one copy,
  as quantizing it alone pads it.

The GEMMs: on CUDA with bf16 values, torch._grouped_mm (ragged rows; ragged tokens for the
weight gradient, on the padded copies: zeros add nothing); elsewhere one GEMM per segment,
bitwise the per-segment path's (the same values and shapes, each expert's weight gradient
summed last segment first, as autograd sums the per-segment path's). The forward keeps the
high-precision input and weight, as the bf16 experts do, and backward quantizes their
columnwise copies (the dense path keeps the input's FP8 bytes instead: this path holds up to
one extra byte per input element until backward). An FP8 parameter of Megatron-FSDP is read
as gathered, rowwise for the forward and columnwise (re-read in backward) for the data
gradient; with a main_grad_sink its dW goes there (`fuse_into_main_grad`). Counts are read
on the host and the call runs eagerly (`fp8_experts.Fp8StackedLinear` takes it outside a
compiled graph), as delayed's does.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.main_grad import fuse_into_main_grad, has_main_grad_sink
from megatron.core.fp8.quantization import backend_for
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor
from megatron.core.fp8.recipe import RecipeSpec
from megatron.core.transformer.moe import grouped_operands as operands


def applies(spec: RecipeSpec, weight: torch.Tensor) -> bool:
    """Whether this function covers a stacked [E, out, in] weight under mxfp8 (`spec`): each
    expert's columnwise cells its own (out a multiple of the 32-row cell)."""
    return weight.dim() == 3 and weight.shape[1] % spec.block == 0


def _values(operand: Fp8Operand | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An operand's exact values: emulated MXFP8 operands hold them (CUDA), FP8 bytes with
    their cells are dequantized (the reference backend)."""
    if operand is None or operand.scale_inv is None:
        return None if operand is None else operand.data
    return operand.dequantize().to(dtype)


def _token_values(t, config: Fp8Config, role: str, dtype, *, rowwise: bool, columnwise: bool):
    """(rowwise values [M, C], transposed columnwise values [C, M]) of a 2-D tensor, each None
    when not asked for: the dense Fp8Linear's quantizers (`backend_for`), one pass."""
    spec = config.spec
    row, col = backend_for(t).quantize_operands(
        t.contiguous(),
        recipe=spec.name,
        fp8_dtype=fp8_dtype_for_role(config.fp8_format, role),
        role=role,
        rowwise=rowwise,
        transposed=columnwise,
        power_2_scale=spec.resolve_power_2_scale(config.quantize_power_2_scale),
        dequant_dtype=dtype,
        saved=False,
    )
    return _values(row, dtype), _values(col, dtype)


def _padded_positions(sizes: list[int], rows: int, block: int, device) -> tuple:
    """Each row's row in the segments' padded copy (each segment zero-padded to whole
    `block`-row cells) and the padded sizes (host lists: this path runs on host counts)."""
    seg_sizes = operands.on_device(sizes, device)
    seg_ids = operands.segment_ids(seg_sizes, rows)
    padded = [-(-size // block) * block for size in sizes]
    return operands.padded_positions(seg_ids, seg_sizes, block), padded


def _stacked_values(weight, config: Fp8Config, dtype, usage: str) -> torch.Tensor:
    """Every expert's values of a stacked weight [E, N, K]: rowwise -> [E, N, K]; columnwise ->
    [E, K, N] (each expert's transposed copy, as the data gradient reads it)."""
    experts, n, k = weight.shape
    columnwise = usage == "columnwise"
    if isinstance(weight, QuantizedTensor):  # an FP8 parameter: its bytes as gathered
        values = _values(_fp8_param_operand(weight, usage, dtype), dtype)
    else:
        rows = weight.detach().reshape(experts * n, k)
        options = dict(rowwise=not columnwise, columnwise=columnwise)
        row, col = _token_values(rows, config, "weight", dtype, **options)
        values = col if columnwise else row
    if columnwise:  # [K, E * N] -> [E, K, N]
        return values.t().reshape(experts, n, k).transpose(1, 2)
    return values.reshape(experts, n, k)


def _fp8_param_operand(weight: QuantizedTensor, usage: str, dtype) -> Fp8Operand:
    """The dense backend's operand of a stacked FP8 parameter's bytes seen as one [E * N, K]
    matrix (each expert's cells are its own: `applies`), as it reads an Fp8Linear's weight."""
    experts, n, k = weight.shape
    direction = "columnwise" if usage == "columnwise" else "rowwise"
    data = getattr(weight, f"{direction}_data")
    scale_inv = getattr(weight, f"{direction}_scale_inv")
    if data is None:
        raise ValueError(f"{weight._label()} has no {direction} copy; quantize it with both")
    matrix = QuantizedTensor(
        shape=(experts * n, k),
        dtype=weight.dtype,
        recipe=weight.recipe,
        fp8_dtype=weight.fp8_dtype,
        role=weight.role,
        **{
            f"{direction}_data": data.reshape(experts * n, k),
            f"{direction}_scale_inv": scale_inv.reshape(-1, scale_inv.shape[-1]),
        },
    )
    return backend_for(data).weight_operand(matrix, usage, compute_dtype=dtype)


def _segment_mm(a, b, sizes: list[int], seg_expert: list[int], out_dtype) -> torch.Tensor:
    """a [M, C] (rows in segments of `sizes`) x b [E, D, C]: rows of segment s @ b[expert]^T
    -> [M, D] in out_dtype, products in the values' dtype."""
    if operands.bf16_grouped_mm_applies(a, b, b.shape[1:]):
        ends = _expert_ends(sizes, seg_expert, b.shape[0], a.device)
        product = torch._grouped_mm(a, b.transpose(1, 2), offs=ends)
        return product if product.dtype == out_dtype else product.to(out_dtype)
    out = a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
    starts = operands.bounds(sizes)
    for s, expert in enumerate(seg_expert):
        if sizes[s]:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = (a[rows] @ b[expert].contiguous().t()).to(out_dtype)
    return out


def _expert_ends(sizes: list[int], seg_expert: list[int], experts: int, device) -> torch.Tensor:
    """Each expert's end row (int32, on `device`) of rows in segments sorted by expert."""
    per_expert = [0] * experts
    for size, expert in zip(sizes, seg_expert):
        per_expert[expert] += size
    return operands.on_device(operands.bounds(per_expert)[1:], device).to(torch.int32)


def _wgrad(dy_t, x_t, padded: list[int], sizes: list[int], seg_expert, shape, out_dtype):
    """dW [E, N, K]: per segment (dy_s^T values) @ (x_s^T values)^T, from the padded
    transposed copies dy_t [N, P] and x_t [K, P], rounded to out_dtype, each expert's
    segments summed last first (an expert without rows: zeros)."""
    if operands.bf16_grouped_mm_applies(dy_t, x_t, (*shape[1:], dy_t.shape[1])):
        ends = _expert_ends(padded, seg_expert, shape[0], dy_t.device)
        product = torch._grouped_mm(dy_t, x_t.t(), offs=ends)
        # An empty group's result is not zeros on every GPU (pytorch/pytorch#172439, sm_100).
        for expert in set(range(shape[0])) - {e for e, n in zip(seg_expert, sizes) if n}:
            product[expert].zero_()
        return product if product.dtype == out_dtype else product.to(out_dtype)
    out = dy_t.new_zeros(shape, dtype=out_dtype)
    starts = operands.bounds(padded)
    for s in reversed(range(len(sizes))):
        if sizes[s]:
            cols = slice(starts[s], starts[s] + sizes[s])
            product = dy_t[:, cols].contiguous() @ x_t[:, cols].contiguous().t()
            out[seg_expert[s]] += product.to(out_dtype)
    return out


class _GroupedMxfp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, layout, config):  # noqa: D102
        sizes, seg_expert = layout
        dtype = backend_for(tokens).emulation_dtype(tokens.dtype)
        x_row, _ = _token_values(tokens, config, "input", dtype, rowwise=True, columnwise=False)
        w_row = _stacked_values(weight, config, dtype, "rowwise")
        ctx.fp8_param = isinstance(weight, QuantizedTensor)
        # The FP8 parameter is re-read in backward (after the engine gathered it again).
        ctx.stacked = weight if ctx.fp8_param else None
        ctx.save_for_backward(tokens, *(() if ctx.fp8_param else (weight.detach(),)))
        ctx.layout, ctx.config, ctx.dtypes = layout, config, (tokens.dtype, weight.dtype, dtype)
        return _segment_mm(x_row, w_row, sizes, seg_expert, tokens.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        tokens, *plain = ctx.saved_tensors
        weight = ctx.stacked if ctx.fp8_param else plain[0]
        sizes, seg_expert = ctx.layout
        x_dtype, w_dtype, dtype = ctx.dtypes
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dy.contiguous()
        dx = dw = None
        if need_dgrad:
            dy_row, _ = _token_values(dy, ctx.config, "grad", dtype, rowwise=True, columnwise=False)
            w_col = _stacked_values(weight, ctx.config, dtype, "columnwise")
            dx = _segment_mm(dy_row, w_col, sizes, seg_expert, x_dtype)
        if need_wgrad:
            dw = _weight_gradient(ctx, dy, tokens, weight)
        ctx.stacked = None
        return dx, dw, None, None


def _weight_gradient(ctx, dy, tokens, weight) -> torch.Tensor | None:
    """dW of the call, handed to an FP8 parameter's main_grad_sink where it has one (then
    autograd gets None)."""
    sizes, seg_expert = ctx.layout
    _, w_dtype, dtype = ctx.dtypes
    position, padded = _padded_positions(sizes, dy.shape[0], ctx.config.spec.block, dy.device)
    columns = []
    for t, role in ((dy, "grad"), (tokens, "input")):
        padded_t = operands.padded_copy(t, position, sum(padded))
        options = dict(rowwise=False, columnwise=True)
        columns.append(_token_values(padded_t, ctx.config, role, dtype, **options)[1])
    args = (*columns, padded, sizes, seg_expert, weight.shape)
    if ctx.fp8_param and has_main_grad_sink(weight):
        # Made in the buffer's dtype (fp32 where a later micro-batch adds it), then written.
        fuse_into_main_grad(weight, lambda target, accumulate: False, lambda d: _wgrad(*args, d))
        return None
    return _wgrad(*args, w_dtype)


def grouped_mxfp8_linear(tokens, weight, segments: list[list[int]], config: Fp8Config):
    """y[rows of expert e] = tokens[rows of e] @ weight[e]^T under mxfp8, all experts in one
    autograd function; segments[e]: expert e's row counts per source rank (host lists, in
    token order); weight: the stacked [E, out, in] parameter, high precision or an FP8
    parameter (a QuantizedTensor)."""
    if isinstance(segments, torch.Tensor):
        raise ValueError("grouped_mxfp8_linear reads the segments' row counts as host lists")
    sizes = [count for counts in segments for count in counts]
    seg_expert = [expert for expert, counts in enumerate(segments) for _ in counts]
    if sum(sizes) != tokens.shape[0]:
        raise ValueError("grouped_mxfp8_linear: the segments must sum to the tokens' rows")
    return _GroupedMxfp8Function.apply(tokens, weight, (sizes, seg_expert), config)
