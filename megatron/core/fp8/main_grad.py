"""Gradient accumulation fusion for FP8 weights (Megatron-LM's `--gradient-accumulation-fusion`,
on by default there and here; `--no-gradient-accumulation-fusion` turns it off).

An engine that keeps a weight's grad in its own buffer sets `QuantizedTensor.main_grad_sink` to
an object with `main_grad_slot(weight) -> (1-D view, accumulate)` and `main_grad_written(weight)`
(Megatron-FSDP sets itself). Fp8Linear's wgrad GEMM then writes the grad into that view in
place, in fp32 (or the buffer's bf16), instead of returning a bf16 grad that a second pass
casts into the buffer; autograd gets no grad for the weight. The routed experts' grouped
function (moe/grouped_fp8.py) writes a stacked FP8 expert weight's dW the same way, through
`fuse_into_main_grad`, with its own op for compiled graphs (with an fp64 buffer each segment's
product is added in fp64 on the CPU). A slot that already holds this
step's grad (a later micro-batch) gets this micro-batch's fp32 product added, so every
micro-batch contributes the same product under any data-parallel layout (fp32; with a bf16
buffer the first micro-batch's is written in bf16). Compiled, dgrad
and the wgrad write are one custom op whose output is dx: a graph drops an op whose output
nothing reads.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.compile import stand_in_gemm, stand_in_weight
from megatron.core.fp8.cuda import linear_ops
from megatron.core.fp8.quantization import backend_for
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor
from megatron.core.fp8.recipe import recipe_spec

_DIRECT_DTYPES = (torch.float32, torch.bfloat16)


def has_main_grad_sink(weight: torch.Tensor) -> bool:
    return getattr(weight, "main_grad_sink", None) is not None


def _gemm_into(dy_t: Fp8Operand, x_t: Fp8Operand, out: torch.Tensor, recipe: str) -> bool:
    """out = dy^T x written in place by torch._scaled_mm where the fused path's GEMM takes the
    operands as they are; False (nothing written) otherwise."""
    if recipe_spec(recipe).fused_linear_emulates:
        return False
    args = dict(recipe=recipe, out_dtype=out.dtype, fast_accum=False, out=out)
    return linear_ops._direct_scaled_mm(dy_t, x_t, **args) is not None


def fuse_into_main_grad(weight: torch.Tensor, write_into, compute) -> None:
    """The fusion's one rule for any FP8 weight (an Fp8Linear's, a stacked expert weight's):
    this micro-batch's dW goes into the weight's slot of its main_grad_sink. Where the buffer is
    fp32 or bf16, `write_into(target, accumulate) -> bool` writes it in place (accumulate: a
    later micro-batch, the slot + the fp32 product rounded once) or declines (False);
    otherwise `compute(dtype)` makes it (fp32 where it is added), and it is copied or added
    into the slot. Then the sink is told."""
    sink = weight.main_grad_sink
    target, accumulate = sink.main_grad_slot(weight)
    target = target.view(weight.shape)
    direct = target.dtype in _DIRECT_DTYPES
    if not (direct and write_into(target, accumulate)):
        # An fp64 buffer gets an fp64 product: a stacked expert weight's segments (expert
        # parallelism) are each added in fp64 there, as the ranks' products are by the reduce.
        wide = target.dtype == torch.float64
        product = compute(target.dtype if wide or (direct and not accumulate) else torch.float32)
        if accumulate:
            target.add_(product)
        else:
            target.copy_(product)
    sink.main_grad_written(weight)


def write_wgrad(weight: QuantizedTensor, dy_t: Fp8Operand, x_t: Fp8Operand, ops) -> None:
    """dW = dy^T x into `weight`'s slot of its main_grad_sink (written by torch._scaled_mm in
    place where the fused path's GEMM takes the operands as they are)."""

    def write_into(target: torch.Tensor, accumulate: bool) -> bool:
        # torch._scaled_mm cannot add to its output: a later micro-batch's product is added.
        if accumulate or ops is not linear_ops:
            return False
        return _gemm_into(dy_t, x_t, target, weight.recipe)

    def compute(dtype: torch.dtype) -> torch.Tensor:  # one fp32 product; added to fp64 exactly
        dtype = torch.float32 if dtype == torch.float64 else dtype
        return ops.gemm(dy_t, x_t, recipe=weight.recipe, out_dtype=dtype, fast_accum=False)

    fuse_into_main_grad(weight, write_into, compute)


def stand_in_backward_gemms(dy_row, dy_t, x_t, stand_in, dx_dtype) -> torch.Tensor:
    """A compiled Fp8Linear's dgrad (returned) and wgrad write: fp8_weight_backward's op."""
    operands = (dy_row, dy_t, x_t)
    tensors = [t for op in operands for t in (op.data, op.scale_inv)]
    cells = [n for op in operands for n in (op.block_rows, op.block_cols)]
    return _fp8_weight_backward(tensors, cells, stand_in, dx_dtype)


@torch.library.custom_op("megatron_fp8::fp8_weight_backward", mutates_args=())
def _fp8_weight_backward(
    tensors: list[torch.Tensor | None],
    cells: list[int],
    stand_in: torch.Tensor,
    dx_dtype: torch.dtype,
) -> torch.Tensor:
    """tensors/cells: the fields of dy's rowwise, dy's transposed and x's transposed operand."""
    weight = stand_in_weight(stand_in)
    dy_row, dy_t, x_t = (
        Fp8Operand(tensors[2 * i], tensors[2 * i + 1], weight.recipe, *cells[2 * i : 2 * i + 2])
        for i in range(3)
    )
    dx = stand_in_gemm(dy_row, stand_in, "columnwise", dx_dtype, False)
    write_wgrad(weight, dy_t, x_t, backend_for(dy_row.data))
    return dx


@_fp8_weight_backward.register_fake
def _(tensors, cells, stand_in, dx_dtype):
    return tensors[0].new_empty((tensors[0].shape[0], stand_in.shape[1]), dtype=dx_dtype)
