#!/usr/bin/env python3
"""GPU probe: which 128x128 scale grids does this torch's `torch._scaled_mm` take, and which
path does `cuda/gemm.py`'s blockwise GEMM settle on per shape?

ScaledBlas.cpp's 128x128 check wants the grid's row stride either contiguous (older) or
padded to a multiple of 4 K-blocks (newer), and skips the stride of a size-1 dimension. This
tries both strides for 4, 5 and 6 K-blocks, with the 128x128 grid on either operand and with
one or two grid rows; then, on random bytes and scales, whether a taken two-row grid is read
right ("contiguous" or "padded": PyTorch #166752 says cuBLASLt wants the K blocks padded to
4, a contiguous odd grid having given silent wrong answers); then
runs `scaled_mm` from a fresh probe state on the shapes of test_cuda_gemm.py and prints the
probe state and the error against the exact product.
Run: python3 dev/probe_blockwise_grids.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.fp8.cuda import gemm, quantize_cuda, scaled_mm  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _grid(rows: int, k_blocks: int, row_stride: int) -> torch.Tensor:
    """A 128x128 grid of an operand with `rows` rows, its rows `row_stride` apart."""
    return torch.ones(-(-rows // 128), row_stride, device="cuda")[:, :k_blocks]


def _taken(k_blocks: int, square_side: str, square_rows: int, row_stride: int) -> str:
    """torch._scaled_mm on zeros a [M, K] x b [N, K]^T: the operand on `square_side` has
    `square_rows` rows and a 128x128 grid, the other 256 rows and a 1x128 grid."""
    k = 128 * k_blocks
    m, n = (square_rows, 256) if square_side == "a" else (256, square_rows)
    a = torch.zeros(m, k, device="cuda").to(E4M3)
    b = torch.zeros(n, k, device="cuda").to(E4M3)
    if square_side == "a":
        scale_a = _grid(m, k_blocks, row_stride)
        scale_b = torch.ones(k_blocks, n, device="cuda")  # b's 1x128, read transposed
    else:
        scale_a = torch.ones(k_blocks, m, device="cuda").t()  # 1x128, outer-dim-major
        scale_b = _grid(n, k_blocks, row_stride).t()
    try:
        torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except RuntimeError as error:
        return "refused: " + str(error).splitlines()[0][:80]
    return "taken"


def _layout(grid: torch.Tensor, k_blocks: int, layout: str) -> torch.Tensor:
    """A [rows, K blocks] grid as torch receives it: "contiguous", or "padded" (rows 4 blocks
    apart, a view sliced to K blocks)."""
    if layout == "contiguous":
        return grid.contiguous()
    wide = torch.ones(grid.shape[0], -(-k_blocks // 4) * 4, device=grid.device)
    wide[:, :k_blocks] = grid
    return wide[:, :k_blocks]


def _numeric(k_blocks: int, square_side: str, layout: str) -> str:
    """torch._scaled_mm on random FP8 bytes and random scales, a 256-row operand with a
    128x128 grid in `layout` (_layout), against the product of the dequantized operands: a
    grid read with the wrong row stride takes its scales from the wrong K blocks."""
    k, rows = 128 * k_blocks, 256
    torch.manual_seed(k_blocks)
    a = torch.randn(rows, k, device="cuda").to(E4M3)
    b = torch.randn(rows, k, device="cuda").to(E4M3)
    square = torch.rand(rows // 128, k_blocks, device="cuda") + 0.5
    per_row = torch.rand(rows, k_blocks, device="cuda") + 0.5
    square_full = square.repeat_interleave(128, 0).repeat_interleave(128, 1)
    row_full = per_row.repeat_interleave(128, 1)
    a_scale_full, b_scale_full = (
        (square_full, row_full) if square_side == "a" else (row_full, square_full)
    )
    exact = (a.float() * a_scale_full) @ (b.float() * b_scale_full).t()
    grid = _layout(square, k_blocks, layout)
    one_by = per_row.t().contiguous()  # 1x128, outer-dim-major: [K blocks, rows]
    scale_a, scale_b = (grid, one_by) if square_side == "a" else (one_by.t(), grid.t())
    try:
        y = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    except RuntimeError as error:
        return "refused: " + str(error).splitlines()[0][:60]
    error = ((y - exact).abs().max() / exact.abs().max()).item()
    # Read right: the fp32 output differs by accumulation order only (~1e-6); a grid
    # read with the wrong stride takes other blocks' scales (~0.4 in a CPU simulation), or
    # reads past the grid (nan).
    verdict = "read right" if error < 1e-2 else "WRONG"
    return f"taken, rel err {error:.2e}: {verdict}"


def _operand(x: torch.Tensor, role: str):
    out = quantize_cuda(x, recipe="blockwise", fp8_dtype=E4M3, role=role, rowwise=True,
                        columnwise=False, power_2_scale=True)  # fmt: skip
    return out["rowwise_data"].view(E4M3), out["rowwise_scale_inv"]


def main() -> None:
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for k_blocks in (4, 5, 6):
        for side in ("a", "b"):
            for rows in (128, 256):  # one grid row (stride unchecked) or two
                for stride in sorted({k_blocks, -(-k_blocks // 4) * 4}):
                    result = _taken(k_blocks, side, rows, stride)
                    print(f"K blocks {k_blocks}, 128x128 on {side} ({rows} rows), "
                          f"row stride {stride}: {result}")  # fmt: skip
    for k_blocks in (4, 5, 6):
        for side in ("a", "b"):
            for layout in ("contiguous", "padded"):
                result = _numeric(k_blocks, side, layout)
                print(f"numeric: K blocks {k_blocks}, 128x128 on {side}, {layout}: {result}")
    for m, k, n in [(256, 512, 384), (130, 640, 260), (64, 768, 256), (96, 576, 128)]:
        for side in ("a", "b"):
            gemm.set_blockwise_path()
            torch.manual_seed(0)
            a, a_scale = _operand(
                torch.randn(m, k, device="cuda"), "weight" if side == "a" else "input"
            )
            b, b_scale = _operand(
                torch.randn(n, k, device="cuda"), "weight" if side == "b" else "input"
            )
            scales = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, recipe="blockwise")
            y = scaled_mm(a, b, **scales, out_dtype=torch.float32, use_fast_accum=False)
            exact = gemm.emulated_mm(a, b, **scales, out_dtype=torch.float32)
            error = ((y - exact).abs().max() / exact.abs().max()).item()
            print(f"{(m, k, n)} 128x128 on {side}: {gemm._blockwise_status}, rel err {error:.2e}")


if __name__ == "__main__":
    main()
