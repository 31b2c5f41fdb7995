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
about 29K programs."""
AMAX_BLOCKS_PER_PROGRAM = 1
"""Blocks per program when the amax is taken. Measured on Model A's shapes (dev/bench_adamw.py,
H200): 1 block 16.6 ms, 4 blocks 20.2 ms (no amax: 15.3 ms; torch's fused AdamW: 21.1 ms)."""


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
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK * BLOCKS_PER_PROGRAM
    running_max = tl.zeros((BLOCK,), dtype=tl.float32)
    for block in tl.static_range(BLOCKS_PER_PROGRAM):
        offsets = first + block * BLOCK + tl.arange(0, BLOCK)
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
            running_max = tl.maximum(running_max, tl.where(mask, tl.abs(param), 0.0))
    if HAS_AMAX:
        # One block reduction and one atomic per program; |param| >= 0, so the float max
        # orders like the bits and masked lanes (0) never win.
        tl.atomic_max(amax_ptr, tl.max(running_max, axis=0))


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
    blocks_per_program = AMAX_BLOCKS_PER_PROGRAM if amax is not None else 1
    grid = (triton.cdiv(numel, BLOCK * blocks_per_program),)
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
            BLOCKS_PER_PROGRAM=blocks_per_program,
            num_warps=8,
        )
