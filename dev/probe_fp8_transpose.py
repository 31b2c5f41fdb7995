#!/usr/bin/env python3
"""GPU probe: do FP8 bytes survive Triton's tl.trans on this GPU and Triton version?

The quantization kernels write a transposed FP8 copy by transposing the bytes of a cast
tile. With the bytes of `.to(fp8)` (two per 16-bit register), Triton 3.6 on an H200 gave
wrong transposed bytes for fp32 inputs, about a third of them; bf16 inputs came out right.
So triton_quantize.py casts tiles it transposes with `_saturating_cast_t` (the same cvt
through inline PTX, one byte per register). This script compares both casts, rowwise and
transposed, with torch for fp32 and bf16 tiles of several shapes, and exits 1 if the
shipped cast (`_saturating_cast_t`) is wrong anywhere. Run: python3 dev/probe_fp8_transpose.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

if not torch.cuda.is_available():
    sys.exit("probe_fp8_transpose.py needs a CUDA GPU (it checks compiled GPU code)")

import triton
import triton.language as tl

from megatron.core.fp8.cuda.triton_common import _saturating_cast, _saturating_cast_t


@triton.jit
def _probe_kernel(
    x_ptr,
    row_ptr,
    t_ptr,
    scale,
    M,
    K,
    SHIPPED: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BK)
    cols = (pid % k_tiles) * BK + tl.arange(0, BK)
    for i in range(GROUP):
        rows = ((pid // k_tiles) * GROUP + i) * BM + tl.arange(0, BM)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        if SHIPPED:
            q = _saturating_cast_t(y, True)
        else:
            q = _saturating_cast(y, True)
        tl.store(row_ptr + offs, q, mask=mask)
        offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(t_ptr + offs_t, tl.trans(q), mask=mask_t)


def main() -> int:
    torch.manual_seed(0)
    rows, cols = 256, 384
    shipped_wrong = 0
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
        x[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e9])
        want = (x.float() * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        for shipped in (False, True):
            for bm, bk, group in ((64, 64, 8), (32, 128, 4), (128, 32, 1)):
                row = torch.empty(rows, cols, dtype=torch.uint8, device="cuda")
                t = torch.empty(cols, rows, dtype=torch.uint8, device="cuda")
                grid = (triton.cdiv(cols, bk) * triton.cdiv(rows, bm * group),)
                _probe_kernel[grid](
                    x, row, t, 2.0, rows, cols, SHIPPED=shipped, BM=bm, BK=bk, GROUP=group
                )
                row_diff = int((row != want).sum())
                t_diff = int((t != want.t()).sum())
                name = "_saturating_cast_t" if shipped else "_saturating_cast (.to(fp8))"
                print(
                    f"{str(dtype):15} {name:27} tile {bm}x{bk}x{group}: "
                    f"rowwise bytes differing {row_diff:6d}, transposed {t_diff:6d}"
                )
                if shipped:
                    shipped_wrong += row_diff + t_diff
    print("shipped cast:", "exact" if shipped_wrong == 0 else f"{shipped_wrong} bytes WRONG")
    return 0 if shipped_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
