"""FusedAdamW's CUDA kernel fills FP8 scale-cell amaxes (`AmaxCells`) as the piece rule does,
run on the CPU in Triton's interpreter.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 dev/check_adamw_cells_interpret.py

No FP8 value is involved (fp32 params and moments), so the interpreter's FP8 rounding does not
matter here. `torch.cuda.device` is bypassed so that the kernel's launch takes CPU tensors. Each
case updates a weight piece with `triton_adamw.adamw_step_` and compares its cell amaxes with
`piece_cell_amax_` (the storage's rule, torch path) of the updated values: bitwise, a NaN
element included.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from megatron.core.fp8.cuda.piece_quantize import cell_geometry, piece_cell_amax_  # noqa: E402
from megatron.core.fp8.recipe import recipe_spec  # noqa: E402
from megatron.core.optimizer import triton_adamw  # noqa: E402
from megatron.core.optimizer.fused_adamw import AmaxCells  # noqa: E402
from megatron.core.optimizer.precision import step_scalars  # noqa: E402

GROUP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# (recipe, weight shape, piece start, piece numel, one-pass cell rows of a stacked weight)
CASES = [
    ("blockwise", (384, 256), 0, 384 * 256, None),
    ("blockwise", (300, 256), 3 * 128, 200 * 256, None),  # a piece from mid-row
    ("tensorwise", (4 * 192, 128), 0, 4 * 192 * 128, 192),  # 4 stacked experts, a cell each
    ("blockwise", (2 * 256, 384), 10 * 384, 300 * 384, 128),  # stacked, 128-row cells
]


def check(recipe, shape, start, numel, cell_rows) -> bool:
    shape = torch.Size(shape)
    param = torch.randn(numel) * 3
    param[17] = float("nan")  # skipped by both rules
    geometry = cell_geometry(shape, recipe, cell_rows=cell_rows)
    cols, cell_r, cell_c, grid_cols = geometry
    grid_rows = -(-shape.numel() // cols // cell_r)
    cells = torch.zeros(grid_rows * grid_cols)
    target = AmaxCells(cells, *geometry, start=start, measure_=None)
    assert target.groups_in_one_cell(triton_adamw.CELL_GROUP)
    triton_adamw.adamw_step_(
        param, torch.randn(numel), exp_avg=torch.zeros(numel), exp_avg_sq=torch.zeros(numel),
        exp_avg_scale=None, exp_avg_sq_scale=None, scalars=step_scalars(dict(GROUP, step=1), 1),
        grad_scale=None, amax=target,
    )  # fmt: skip
    want = torch.zeros_like(cells)
    piece_cell_amax_(param, want, shape=shape, spec=recipe_spec(recipe), columnwise=False,
                     param_start=start, cell_rows=cell_rows)  # fmt: skip
    same = torch.equal(cells, want)
    print(
        f"{recipe} {tuple(shape)} from {start}: {cells.numel()} cells", "ok" if same else "DIFFER"
    )
    return same


def main() -> int:
    torch.manual_seed(0)
    # The kernel's launch enters `torch.cuda.device(param.device)`: CPU tensors here.
    torch.cuda.device = lambda device: contextlib.nullcontext()
    results = [check(*case) for case in CASES]
    print("ALL OK" if all(results) else "FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
