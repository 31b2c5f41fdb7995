"""Triton kernel of grad_copy.write_grad_: fp32 slot = (or +=) a bf16/fp16 grad.

Imported only on first use on a CUDA tensor (grad_copy._triton_kernels), so that the package
imports without Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Elements per program: 8 KiB of bf16 read, 16 KiB of fp32 written (16-byte vectors per
thread at 8 warps), large enough that a 100M-element slot launches ~25K programs, not 100K."""


@triton.jit
def _cast_into_kernel(target_ptr, source_ptr, numel, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(source_ptr + offsets, mask=mask).to(tl.float32)
    if ACCUMULATE:
        values = tl.load(target_ptr + offsets, mask=mask) + values
    tl.store(target_ptr + offsets, values, mask=mask)


def cast_into(target: torch.Tensor, source: torch.Tensor, *, accumulate: bool) -> None:
    """target (fp32, contiguous, CUDA) = or += source (bf16/fp16, contiguous, same numel)."""
    numel = target.numel()
    if numel == 0:
        return
    grid = (triton.cdiv(numel, BLOCK),)
    with torch.cuda.device(target.device):
        _cast_into_kernel[grid](
            target, source, numel, ACCUMULATE=accumulate, BLOCK=BLOCK, num_warps=8
        )
