"""Triton kernel of fused_adamw.FusedAdamW: one pass of AdamW over one fp32 parameter.

Imported only on first use on CUDA tensors (fused_adamw._triton_kernel), so that the package
imports without Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Elements per program: 16-byte vectors per thread at 8 warps; a 117M-element weight launches
about 29K programs. With the amax, one block per program measured best on Model A's shapes
(dev/bench_adamw.py, H200): 16.6 ms, against 20.2 ms for 4 blocks per program with one
reduction (no amax: 15.3 ms; torch's fused AdamW: 21.1 ms)."""


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    grad_scale_ptr,
    amax_ptr,
    numel,
    decay_factor,
    beta1,
    beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    # The order of torch's fused AdamW (decoupled decay first, then the moments).
    param = param * decay_factor
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * exp_avg / denom
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if HAS_AMAX:
        # |param| >= 0, so the float max orders like the bits; masked lanes contribute 0.
        tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(param), 0.0), axis=0))


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    decay_factor: float,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: float,
    bias_correction2_sqrt: float,
    grad_scale: torch.Tensor | None,
    amax: torch.Tensor | None,
) -> None:
    """One AdamW update of a contiguous fp32 CUDA param (and its moments) in place; `amax`
    (a 0-d fp32 tensor) is raised to max |updated param| when given."""
    numel = param.numel()
    if numel == 0:
        return
    grid = (triton.cdiv(numel, BLOCK),)
    with torch.cuda.device(param.device):
        _adamw_kernel[grid](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            grad_scale if grad_scale is not None else param,
            amax if amax is not None else param,
            numel,
            decay_factor,
            beta1,
            beta2,
            eps,
            step_size,
            bias_correction2_sqrt,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_AMAX=amax is not None,
            BLOCK=BLOCK,
            num_warps=8,
        )
