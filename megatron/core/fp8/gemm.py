"""FP8 GEMM Y = A B^T with both operands quantized along the contraction dim K.

Emulation (CPU, MXFP8 below sm_100, blockwise on sm_100+, any shape the hardware path cannot
take): dequantize each operand exactly in fp32, multiply in fp32, cast to out_dtype. On CUDA
the per-tensor recipes (sm_89+) and blockwise (sm_90 only) call the fused
`megatron.core.fp8.cuda.scaled_mm`; mxfp8 calls it only on sm_100+, because the 1x32 scaled
GEMM crashes on sm_90 (ARCHITECTURE.md, hardware paths).
"""

from __future__ import annotations

import functools

import torch

from megatron.core.fp8.formats import E5M2, e8m0_to_fp32
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor

ACCUMULATE = ("split", "fast")


@functools.cache
def _cuda_scaled_mm():
    try:
        from megatron.core.fp8.cuda import scaled_mm
    except ImportError:
        return None
    return scaled_mm


def dequantize_operand(operand: Fp8Operand) -> torch.Tensor:
    """Exact fp32 values of an operand: q * scale_inv per element (padding cropped)."""
    q = operand.data.view(operand.fp8_dtype).to(torch.float32)
    if operand.block_cols == 0:  # per-tensor
        return q * operand.scale_inv.to(torch.float32).reshape(())
    if operand.spec.e8m0_scales:
        multiplier = e8m0_to_fp32(operand.scale_inv)
    else:
        multiplier = operand.scale_inv.to(torch.float32)
    rows, cols = q.shape
    full = multiplier.repeat_interleave(operand.block_rows, dim=0)
    full = full.repeat_interleave(operand.block_cols, dim=1)[:rows, :cols]
    return q * full


def _as_operand(value: QuantizedTensor | Fp8Operand) -> Fp8Operand:
    return value.gemm_operand("rowwise") if isinstance(value, QuantizedTensor) else value


def _check(a: Fp8Operand, b: Fp8Operand, accumulate: str) -> None:
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be 'split' or 'fast', got {accumulate!r}")
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"fp8_gemm computes A B^T with A [M, K] and B [N, K]; got A {tuple(a.data.shape)} "
            f"and B {tuple(b.data.shape)}"
        )
    if a.spec != b.spec:
        raise ValueError(f"both operands need one recipe, got {a.recipe} and {b.recipe}")
    if a.fp8_dtype == E5M2 and b.fp8_dtype == E5M2:
        raise ValueError("E5M2 x E5M2 GEMMs are not allowed: quantize one operand as E4M3")
    if a.block_rows > 1 and b.block_rows > 1:
        raise ValueError("at most one operand of a GEMM may be 128x128-scaled")
    if accumulate == "fast" and not a.spec.fast_accumulation:
        raise ValueError(f"{a.recipe} GEMMs use split accumulation; pass accumulate='split'")


def _hardware_path_applies(a: Fp8Operand, device: torch.device) -> bool:
    if device.type != "cuda" or _cuda_scaled_mm() is None:
        return False
    # sm_89+ per tensor, sm_90 only for blockwise, sm_100+ for mxfp8 (its 1x32 GEMM crashes
    # on sm_90): RecipeSpec.gemm_min_capability / gemm_max_major.
    return a.spec.hardware_gemm(tuple(torch.cuda.get_device_capability(device)))


def fp8_gemm(
    a: QuantizedTensor | Fp8Operand,
    b: QuantizedTensor | Fp8Operand,
    *,
    out_dtype: torch.dtype,
    accumulate: str = "split",
) -> torch.Tensor:
    """Y [M, N] = A B^T for A [M, K], B [N, K] quantized along K.

    A QuantizedTensor argument contributes its rowwise copy; pass
    `qt.gemm_operand("columnwise")` to contract over its first dim instead.
    accumulate: "fast" (per-tensor fprop only) or "split" (promoted accumulation).
    """
    a_op, b_op = _as_operand(a), _as_operand(b)
    _check(a_op, b_op, accumulate)
    if _hardware_path_applies(a_op, a_op.data.device):
        return _cuda_scaled_mm()(
            a_op.data.view(a_op.fp8_dtype),
            b_op.data.view(b_op.fp8_dtype),
            a_scale_inv=a_op.scale_inv,
            b_scale_inv=b_op.scale_inv,
            recipe=a_op.recipe,
            out_dtype=out_dtype,
            use_fast_accum=accumulate == "fast",
        )
    product = dequantize_operand(a_op) @ dequantize_operand(b_op).t()
    return product.to(out_dtype)
