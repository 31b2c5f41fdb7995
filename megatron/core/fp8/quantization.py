"""The public FP8 API: `quantize` (a tensor -> QuantizedTensor) and `fp8_gemm` (FP8_NUMERICS.md
API), over two backends with one interface, chosen in one place, `backend_for`: the reference
rules in pure PyTorch (`reference_ops`) and the fused CUDA/Triton kernels
(`cuda.linear_ops`), which must give the same bytes and scales. Fp8Linear quantizes and
multiplies through `backend_for(x).quantize_operands` / `.gemm` (GEMM-ready operands).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.fp8 import reference_ops
from megatron.core.fp8.cuda import linear_ops
from megatron.core.fp8.formats import check_fp8_dtype
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor, register_quantize
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import (
    INPUT_DTYPES,
    check_quantize_args,
    e8m0_from_amax,
    scale_from_amax,
)
from megatron.core.numerics import amax_ignoring_nan

BACKENDS = ("auto", "reference", "cuda")


def backend_for(x: torch.Tensor, backend: str = "auto"):
    """The one backend choice: the module that quantizes and multiplies tensors on x's device.
    "auto": `cuda.linear_ops` where its fused kernels run (a CUDA tensor, Triton importable),
    else `reference_ops`; "cuda" forces linear_ops on a CUDA tensor (its quantizer falls back
    to plain torch without Triton, same bytes); "reference" is always reference_ops."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cuda" and not x.is_cuda:
        raise RuntimeError("backend='cuda' needs a CUDA tensor; use backend='auto' or 'reference'")
    if backend == "cuda" or (backend == "auto" and linear_ops.available(x)):
        return linear_ops
    return reference_ops


def quantize(
    x: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool = True,
    columnwise: bool = False,
    scale: torch.Tensor | None = None,
    power_2_scale: bool | None = None,
    amax: torch.Tensor | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> QuantizedTensor:
    """Quantize x ([..., K], fp32/bf16/fp16) to FP8 under `recipe` (FP8_NUMERICS.md).

    role: "input" | "weight" | "grad". scale: delayed only. amax: tensorwise only, a global amax
    already reduced; amax_reduction_group: tensorwise only, all-reduce MAX the local amax first
    (a sharded tensor then quantizes as the whole would). power_2_scale: None = recipe default.
    The result's `amax` is the amax used or recorded (delayed: local, reduced per step).
    """
    ops = backend_for(x, backend)
    spec = recipe_spec(recipe)
    check_quantize_args(
        spec,
        role=role,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise,
        columnwise=columnwise,
        scale=scale,
        amax=amax,
        power_2_scale=power_2_scale,
    )
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"quantize takes fp32, bf16 or fp16 tensors, got {x.dtype}; cast first")
    if amax_reduction_group is not None and spec.accepts_global_amax and amax is None:
        amax = amax_ignoring_nan(x).reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_reduction_group)
        amax = amax.reshape(())
    parts = ops.quantize_parts(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=rowwise,
        columnwise=columnwise,
        scale=scale,
        power_2_scale=spec.resolve_power_2_scale(power_2_scale),
        amax=amax,
    )
    meta = dict(shape=x.shape, dtype=x.dtype, recipe=recipe, fp8_dtype=fp8_dtype, role=role)
    return QuantizedTensor(**meta, **parts)


def fp8_gemm(
    a: QuantizedTensor | Fp8Operand,
    b: QuantizedTensor | Fp8Operand,
    *,
    out_dtype: torch.dtype,
    accumulate: str = "split",
) -> torch.Tensor:
    """Y [M, N] = A B^T for A [M, K], B [N, K] quantized along K (the one public FP8 GEMM).

    A QuantizedTensor contributes its rowwise copy (`qt.gemm_operand("columnwise")` contracts over
    its first dim). accumulate: "fast" (per-tensor fprop only) or "split". Stored-layout operands
    go to the reference backend, whose GEMM takes the hardware path where the GPU has one.
    """
    if accumulate not in ("split", "fast"):
        raise ValueError(f"accumulate must be 'split' or 'fast', got {accumulate!r}")
    a, b = (v.gemm_operand("rowwise") if isinstance(v, QuantizedTensor) else v for v in (a, b))
    fast = accumulate == "fast"
    return reference_ops.gemm(a, b, recipe=a.recipe, out_dtype=out_dtype, fast_accum=fast)


def compute_scale(
    amax: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    power_2_scale: bool | None = None,
    input_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Scale(s) from (global) amax(es) exactly as `quantize` derives them, elementwise: for the
    FSDP engine, after one packed MAX all-reduce of all weights' amaxes. tensorwise/blockwise:
    fp8_max / amax with FP8_NUMERICS.md's guards; mxfp8: the E8M0 bytes; delayed: use
    `reference.delayed_scale_update` (the scale comes from the history).
    """
    check_fp8_dtype(fp8_dtype)
    spec = recipe_spec(recipe)
    if spec.delayed:
        raise ValueError(
            f"compute_scale handles tensorwise, blockwise and mxfp8, got {recipe!r}; delayed "
            "scales come from the amax history (reference.delayed_scale_update)"
        )
    if spec.e8m0_scales:
        return e8m0_from_amax(amax, fp8_dtype)
    return scale_from_amax(
        amax,
        fp8_dtype=fp8_dtype,
        power_2_scale=spec.resolve_power_2_scale(power_2_scale),
        infinite_scale_value=spec.infinite_scale_value(input_dtype),
    )


register_quantize(quantize)
