"""GEMM-ready FP8 operands for Fp8Linear on CUDA: one fused quantize pass per tensor.

Each call reads the high-precision tensor once and writes exactly the copies the GEMMs of
FP8_NUMERICS.md ("Which copy each GEMM reads") need, already in the layout torch._scaled_mm
takes, so no `.t().contiguous()` copy and no host sync happens inside a training step:

| recipe | `rowwise` operand [M, K] | `transposed` operand [K, M] (contracts over M) |
|---|---|---|
| delayed, tensorwise | bytes, 0-d scale_inv | transposed bytes, same scale_inv |
| blockwise 1x128 | bytes, (M, K/128) outer-dim-major | 128x1 bytes transposed, (K, M/128) |
| blockwise 128x128 | bytes, (M/128, K/128) | transposed bytes and grid |
| mxfp8 (emulated) | dequantize(1x32 quantize(x)) | dequantize(32x1 quantize(x)), [M, K] |

Delayed scaling records max|x| inside the cast kernel into slot 0 of the tensor's amax history
(an atomic max on the fp32 bits), so the step needs no separate amax op. MXFP8 on sm_90 has no
hardware GEMM: the fused kernel writes the dequantized values, which the caller multiplies in
bf16 with fp32 accumulation (exact products, same as dequantize-then-multiply in fp32 up to the
accumulation order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron.core.fp8.cuda import quantize as cq
from megatron.core.fp8.cuda.formats import BLOCK_128, ceil_div
from megatron.core.fp8.cuda.gemm import scaled_mm

PER_TENSOR = ("delayed", "tensorwise")


class GemmOperand(NamedTuple):
    """A GEMM operand contracted over its last dim: FP8 data (viewed as its FP8 dtype) with
    scale_inv in the layout scaled_mm takes, or for emulated MXFP8 high-precision values."""

    data: torch.Tensor
    scale_inv: torch.Tensor | None


def available(x: torch.Tensor) -> bool:
    """Whether the fused path runs for x (a CUDA tensor and importable Triton kernels)."""
    return x.is_cuda and cq.triton_available()


def emulation_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """Dequantized MXFP8 values are exact in bf16 (8 bits of precision hold E4M3/E5M2's 4 and
    3, same exponent range as fp32); other inputs keep fp32 so that nothing is rounded."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


def quantize_operands(
    x2d: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    transposed: bool,
    power_2_scale: bool,
    scale: torch.Tensor | None = None,
    amax_history: torch.Tensor | None = None,
    dequant_dtype: torch.dtype | None = None,
    amax_cell: torch.Tensor | None = None,
) -> tuple[GemmOperand | None, GemmOperand | None]:
    """(rowwise operand, transposed operand) of a 2-D tensor, each None when not asked for.

    delayed: `scale` is the current 0-d scale; `amax_history` (fp32, contiguous), when given,
    gets max|x| atomically maxed into its slot 0. tensorwise: `amax_cell`, when given, is a
    zeroed 0-d int32 tensor the amax pass maxes into (a caller quantizing several tensors
    zeroes all their cells with one fill, see `amax_cells`); else one is allocated here.
    The bytes equal `quantize(...)`'s exactly. mxfp8: the dequantized values come in
    `dequant_dtype` (default: `emulation_dtype`).
    """
    x2d = x2d.contiguous()
    if x2d.numel() == 0:
        raise ValueError("Fp8Linear cannot quantize an empty tensor")
    if recipe in PER_TENSOR:
        return _per_tensor(x2d, recipe=recipe, fp8_dtype=fp8_dtype, rowwise=rowwise,
                           transposed=transposed, power_2_scale=power_2_scale, scale=scale,
                           amax_history=amax_history, amax_cell=amax_cell)  # fmt: skip
    if recipe == "blockwise":
        run = _block_128x128 if role == "weight" else _block_1x128
        return run(x2d, fp8_dtype=fp8_dtype, rowwise=rowwise, transposed=transposed,
                   power_2_scale=power_2_scale)  # fmt: skip
    if recipe == "mxfp8":
        dtype = dequant_dtype or emulation_dtype(x2d.dtype)
        return _mxfp8_dequantized(x2d, fp8_dtype=fp8_dtype, rowwise=rowwise,
                                  transposed=transposed, dtype=dtype)  # fmt: skip
    raise ValueError(f"unknown recipe {recipe!r}")


def _empty(rows: int, cols: int, device: torch.device, dtype=torch.uint8) -> torch.Tensor:
    return torch.empty((rows, cols), dtype=dtype, device=device)


def amax_cells(count: int, device: torch.device) -> torch.Tensor:
    """`count` zeroed int32 amax cells (fp32 bits; +0.0 is 0) from one fill: index one per
    tensor and pass it as `amax_cell`."""
    return torch.zeros(count, dtype=torch.int32, device=device)


def _per_tensor(x2d, *, recipe, fp8_dtype, rowwise, transposed, power_2_scale, scale,
                amax_history, amax_cell):  # fmt: skip
    rows, cols = x2d.shape
    device = x2d.device
    delayed = recipe == "delayed"
    amax = None
    if not delayed:
        amax_bits = amax_cell if amax_cell is not None else amax_cells(1, device)[0]
        cq.launch_amax(x2d, amax_bits)
        amax = amax_bits.view(torch.float32)
    data = _empty(rows, cols, device) if rowwise else None
    data_t = _empty(cols, rows, device) if transposed else None
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    record = amax_history.view(torch.int32) if (delayed and amax_history is not None) else None
    cq.launch_per_tensor_cast(
        x2d, data=data, data_t=data_t, scale=scale, amax=amax, scale_inv=scale_inv,
        record_bits=record, fp8_dtype=fp8_dtype, recipe=recipe, power_2_scale=power_2_scale,
    )  # fmt: skip
    row = GemmOperand(data.view(fp8_dtype), scale_inv) if rowwise else None
    col = GemmOperand(data_t.view(fp8_dtype), scale_inv) if transposed else None
    return row, col


def _block_1x128(x2d, *, fp8_dtype, rowwise, transposed, power_2_scale):
    rows, cols = x2d.shape
    device = x2d.device
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    row = _empty(rows, cols, device) if rowwise else None
    # Stored [K/128, M]: its .t() is the (M, K/128) outer-dim-major grid cuBLAS reads.
    row_sinv_t = _empty(col_blocks, rows, device, torch.float32) if rowwise else None
    col_t = _empty(cols, rows, device) if transposed else None
    col_sinv = _empty(row_blocks, cols, device, torch.float32) if transposed else None
    cq.launch_block_1x128(
        x2d, row=row, row_sinv=row_sinv_t, col=None, col_sinv=col_sinv, col_t=col_t,
        record_bits=None, row_scale_t=True, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale,
    )  # fmt: skip
    row_op = GemmOperand(row.view(fp8_dtype), row_sinv_t.t()) if rowwise else None
    # The transposed operand [K, M] has 1x128 blocks along M: grid (K, M/128) = col_sinv.t().
    col_op = GemmOperand(col_t.view(fp8_dtype), col_sinv.t()) if transposed else None
    return row_op, col_op


def _block_128x128(x2d, *, fp8_dtype, rowwise, transposed, power_2_scale):
    rows, cols = x2d.shape
    device = x2d.device
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    data = _empty(rows, cols, device) if rowwise else None
    scale_inv = _empty(row_blocks, col_blocks, device, torch.float32)
    data_t = _empty(cols, rows, device) if transposed else None
    scale_inv_t = _empty(col_blocks, row_blocks, device, torch.float32) if transposed else None
    cq.launch_block_128x128(
        x2d, data=data, scale_inv=scale_inv, data_t=data_t, scale_inv_t=scale_inv_t,
        record_bits=None, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale,
    )  # fmt: skip
    row_op = GemmOperand(data.view(fp8_dtype), scale_inv) if rowwise else None
    col_op = GemmOperand(data_t.view(fp8_dtype), scale_inv_t) if transposed else None
    return row_op, col_op


def _mxfp8_dequantized(x2d, *, fp8_dtype, rowwise, transposed, dtype):
    # Ragged edges need no care: the kernel's masked loads zero-pad the blocks, as the rules do.
    rows, cols = x2d.shape
    row = _empty(rows, cols, x2d.device, dtype) if rowwise else None
    col = _empty(rows, cols, x2d.device, dtype) if transposed else None
    cq.launch_mxfp8(x2d, row=row, row_e=None, col=col, col_e=None, col_t=None,
                    record_bits=None, fp8_dtype=fp8_dtype, dequant=True)  # fmt: skip
    # The columnwise values keep x's shape; the transposed operand is a view (bf16 GEMMs take
    # either layout, so no copy).
    return (
        GemmOperand(row, None) if rowwise else None,
        GemmOperand(col.t(), None) if transposed else None,
    )


def weight_operand(weight, usage: str, *, compute_dtype: torch.dtype) -> GemmOperand:
    """The operand of an FP8 parameter (a QuantizedTensor): "rowwise" for fprop, "columnwise"
    (the [K, N] transpose) for dgrad. MXFP8 bytes go through the fused dequantize kernel."""
    if weight.recipe != "mxfp8":
        operand = weight.gemm_operand(usage)
        return GemmOperand(operand.data.view(operand.fp8_dtype), operand.scale_inv)
    columnwise = usage == "columnwise"
    data = weight.columnwise_data if columnwise else weight.rowwise_data
    scale_inv = weight.columnwise_scale_inv if columnwise else weight.rowwise_scale_inv
    if data is None:
        raise ValueError(f"the FP8 mxfp8 weight has no {usage} copy; quantize it with both")
    values = cq.mxfp8_dequantize(
        data.reshape(-1, weight.shape[-1]), scale_inv, fp8_dtype=weight.fp8_dtype,
        columnwise=columnwise, out_dtype=compute_dtype,
    )  # fmt: skip
    return GemmOperand(values.t() if columnwise else values, None)


def gemm(
    a: GemmOperand, b: GemmOperand, *, recipe: str, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """[rows_a, rows_b] = A B^T, both contracted over their last dim."""
    if recipe == "mxfp8":
        product = torch.mm(a.data, b.data.t())
        return product if product.dtype == out_dtype else product.to(out_dtype)
    return scaled_mm(a.data, b.data, a_scale_inv=a.scale_inv, b_scale_inv=b.scale_inv,
                     recipe=recipe, out_dtype=out_dtype, use_fast_accum=fast_accum)  # fmt: skip
