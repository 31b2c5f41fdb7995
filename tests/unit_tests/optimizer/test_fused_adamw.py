"""FusedAdamW: torch.optim.AdamW's update and state, one Triton pass per parameter on CUDA, and
the amax of every updated parameter for FP8 re-quantization.

CPU runs torch's own step (the twin of the CUDA path: same class, same amax contract), and
`_kernel_math` (the Triton kernel's formulas in torch) is checked against torch's fused AdamW on
CPU; the GPU tests check the kernel against torch's fused CUDA AdamW and against that math.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron.core.optimizer import FusedAdamW

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; its CPU twin runs instead"
)
SHAPES = [(300, 77), (4096 * 3 + 5,), (1,), (64, 64)]  # not multiples of the kernel's block
BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 3e-3, 0.1


def _params(device: str, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).to(device).requires_grad_() for s in SHAPES]


def _grads(step: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator).to(device) for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": WD}, {"params": params[2:], "weight_decay": 0.0}]


def _train(optimizer, params, device, *, steps, first=0, grad_scale=None, amax=False):
    amaxes = []
    for step in range(first, first + steps):
        for param, grad in zip(params, _grads(step, device)):
            param.grad = grad
        params[2].grad = None  # a param without a grad this step: no update, still measured
        if grad_scale is not None:
            optimizer.grad_scale = torch.tensor(grad_scale, device=device)
        targets = {p: torch.zeros((), device=device) for p in params} if amax else {}
        if isinstance(optimizer, FusedAdamW):
            optimizer.amax_targets = targets
        optimizer.step()
        amaxes.append(targets)
        if grad_scale is not None:
            del optimizer.grad_scale
    return amaxes


def test_cpu_step_and_state_are_torch_adamw():
    ours_params, torch_params = _params("cpu"), _params("cpu")
    ours = FusedAdamW(_groups(ours_params), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    reference = torch.optim.AdamW(_groups(torch_params), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    amaxes = _train(ours, ours_params, "cpu", steps=3, amax=True)
    _train(reference, torch_params, "cpu", steps=3)
    for a, b in zip(ours_params, torch_params):
        assert torch.equal(a, b)
    # Every target, the grad-less param's too, holds max |param| after the step, exactly.
    for param, amax in amaxes[-1].items():
        assert amax.item() == param.detach().abs().max().item()
    state, want = ours.state_dict(), reference.state_dict()
    assert state["param_groups"] == want["param_groups"]
    assert state["state"].keys() == want["state"].keys()
    for key, entry in state["state"].items():
        assert entry.keys() == want["state"][key].keys()
        for name in entry:
            assert torch.equal(entry[name], want["state"][key][name]), (key, name)


def _kernel_math(param, grad, exp_avg, exp_avg_sq, *, step, lr, wd, grad_scale=None):
    """The Triton kernel's update, term for term, in fp32 torch ops."""
    grad = grad.float() if grad_scale is None else grad.float() / grad_scale
    param = param * (1.0 - lr * wd)
    exp_avg = BETAS[0] * exp_avg + (1.0 - BETAS[0]) * grad
    exp_avg_sq = BETAS[1] * exp_avg_sq + (1.0 - BETAS[1]) * grad * grad
    denom = exp_avg_sq.sqrt() / math.sqrt(1.0 - BETAS[1] ** step) + EPS
    return param - (lr / (1.0 - BETAS[0] ** step)) * exp_avg / denom, exp_avg, exp_avg_sq


def _kernel_math_run(params, device, *, steps, grad_scale=None):
    params = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(steps):
        for i, grad in enumerate(_grads(step, device)):
            if i == 2:
                continue
            wd = WD if i < 2 else 0.0
            params[i], m, v = _kernel_math(
                params[i],
                grad,
                *moments[i],
                step=step + 1,
                lr=LR,
                wd=wd,
                grad_scale=grad_scale,
            )
            moments[i] = (m, v)
    return params


def test_kernel_math_matches_torch_fused_adamw_on_cpu():
    """CPU twin of the Triton kernel: its formulas against torch's fused AdamW (CPU build)."""
    torch_params = _params("cpu")
    reference = torch.optim.AdamW(_groups(torch_params), lr=LR, betas=BETAS, eps=EPS, fused=True)
    _train(reference, torch_params, "cpu", steps=4, grad_scale=2.5)
    ours = _kernel_math_run(_params("cpu"), "cpu", steps=4, grad_scale=2.5)
    for a, b in zip(ours, torch_params):
        torch.testing.assert_close(a, b.detach(), rtol=2e-6, atol=1e-7)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("grad_scale", [None, 2.5])
def test_triton_step_matches_torch_fused_adamw_on_gpu(grad_scale):
    from megatron.core.optimizer import fused_adamw

    assert fused_adamw._triton_kernel() is not None, "Triton is needed on the GPU machine"
    ours_params, torch_params = _params("cuda"), _params("cuda")
    ours = FusedAdamW(_groups(ours_params), lr=LR, betas=BETAS, eps=EPS, fused=True)
    assert ours._triton_usable()
    reference = torch.optim.AdamW(_groups(torch_params), lr=LR, betas=BETAS, eps=EPS, fused=True)
    amaxes = _train(ours, ours_params, "cuda", steps=4, grad_scale=grad_scale, amax=True)
    _train(reference, torch_params, "cuda", steps=4, grad_scale=grad_scale)
    math_params = _kernel_math_run(_params("cuda"), "cuda", steps=4, grad_scale=grad_scale)
    for a, b, c in zip(ours_params, torch_params, math_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(a.detach(), c, rtol=1e-6, atol=1e-8)
    for param, amax in amaxes[-1].items():
        assert amax.item() == param.detach().abs().max().item()
    # Moments: the kernel may fuse beta * m + (1 - beta) * g into one FMA; near-zero moments
    # then differ from torch's by an ulp of the terms (about 3e-8 measured), not of the sum.
    for key in ("exp_avg", "exp_avg_sq"):
        for a, b in zip(ours_params, torch_params):
            if a is ours_params[2]:
                continue
            torch.testing.assert_close(
                ours.state[a][key], reference.state[b][key], rtol=2e-6, atol=1e-7
            )
    steps = [ours.state[p]["step"].item() for p in ours_params if p in ours.state]
    want = [reference.state[p]["step"].item() for p in torch_params if p in reference.state]
    assert steps == want
    # The same class with torch's step (A/B switch, use_triton=False) is torch's AdamW.
    ours.use_triton = False
    assert not ours._triton_usable() and ours._torch_adamw_step()


@needs_cuda
@pytest.mark.gpu
def test_triton_step_resumes_from_a_state_dict_on_gpu():
    uninterrupted = _params("cuda")
    opt = FusedAdamW(_groups(uninterrupted), lr=LR, betas=BETAS, eps=EPS, fused=True)
    _train(opt, uninterrupted, "cuda", steps=5)
    resumed = _params("cuda")
    first = FusedAdamW(_groups(resumed), lr=LR, betas=BETAS, eps=EPS, fused=True)
    _train(first, resumed, "cuda", steps=2)
    saved = first.state_dict()
    second = FusedAdamW(_groups(resumed), lr=LR, betas=BETAS, eps=EPS, fused=True)
    second.load_state_dict(saved)
    _train(second, resumed, "cuda", steps=3, first=2)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)


# (weight shape, piece start, piece numel, cell rows, cell cols): a 128x128-block weight whole
# and a piece of one from mid-row; a stacked expert weight [4 x 192, 128] with one cell per
# expert; columns (100) that no 128-element group divides (measured after the step instead).
CELL_CASES = [
    ((384, 256), 0, 384 * 256, 128, 128),
    ((300, 256), 3 * 128, 200 * 256, 128, 128),
    ((4 * 192, 128), 0, 4 * 192 * 128, 192, 1 << 30),
    ((256, 100), 0, 256 * 100, 128, 128),
]


def _cells_reference(values, shape, start, cell_rows, cell_cols) -> torch.Tensor:
    """Plain torch: each cell's max |value| over the piece's elements (0 where none)."""
    rows, cols = shape
    full = torch.zeros(rows * cols, dtype=torch.float32)
    full[start : start + values.numel()] = values.detach().abs().float().cpu()
    grid = full.view(rows, cols)
    cell_cols = min(cell_cols, cols)
    out = [
        grid[r : r + cell_rows, c : c + cell_cols].max()
        for r in range(0, rows, cell_rows)
        for c in range(0, cols, cell_cols)
    ]
    return torch.stack(out)


def _cell_targets(params) -> list:
    from megatron.core.fp8.cuda.piece_quantize import piece_cell_amax_
    from megatron.core.fp8.recipe import recipe_spec
    from megatron.core.optimizer.fused_adamw import AmaxCells

    targets = []
    for param, (shape, start, _, cell_rows, cell_cols) in zip(params, CELL_CASES):
        rows, cols = shape
        grid_cols = -(-cols // min(cell_cols, cols))
        cells = torch.zeros(-(-rows // cell_rows) * grid_cols, device=param.device)
        spec = recipe_spec("tensorwise" if cell_cols > cols else "blockwise")
        where = dict(shape=torch.Size(shape), spec=spec, columnwise=False, param_start=start)
        where.update(cell_rows=cell_rows if spec.per_tensor else None)
        measure = functools.partial(piece_cell_amax_, cell_amax=cells, **where)
        targets.append(AmaxCells(cells, cols, cell_rows, cell_cols, grid_cols, start, measure))
    return targets


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]
)
def test_step_fills_the_cell_amaxes_of_fp8_weights(device):
    """AmaxCells targets (FP8 block cells, per-expert cells) hold each cell's max |updated
    param| after a step, as plain torch computes it: on CUDA from the Triton pass itself where
    128-element groups lie in one cell, measured after the step elsewhere and on CPU."""
    generator = torch.Generator().manual_seed(3)
    params = [
        (torch.randn(numel, generator=generator) * (1 + i)).to(device).requires_grad_()
        for i, (_, _, numel, _, _) in enumerate(CELL_CASES)
    ]
    optimizer = FusedAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    targets = _cell_targets(params)
    assert [t.groups_in_one_cell(128) for t in targets] == [True, True, True, False]
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        for target in targets:
            target.cells.zero_()
        optimizer.amax_targets = dict(zip(params, targets))
        optimizer.step()
    for param, target, (shape, start, _, cell_rows, cell_cols) in zip(params, targets, CELL_CASES):
        want = _cells_reference(param, shape, start, cell_rows, cell_cols)
        assert torch.equal(target.cells.cpu(), want), shape


def test_cpu_amax_skips_nan_as_the_kernel_and_the_fp8_storage_do():
    """A NaN element (a diverged weight) leaves a 0-d amax at the max of the other elements,
    as the Triton pass's hardware max and the FP8 storage's measured rule give it."""
    param = torch.tensor([1.0, float("nan"), -3.0, 2.0], requires_grad=True)
    optimizer = FusedAdamW([param], lr=0.0, weight_decay=0.0)
    param.grad = torch.zeros(4)
    amax = torch.zeros(())
    optimizer.amax_targets = {param: amax}
    optimizer.step()
    assert amax.item() == 3.0
