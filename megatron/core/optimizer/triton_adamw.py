"""Triton kernel of fused_adamw.FusedAdamW: one pass of AdamW over one parameter, its moments
in fp32, bf16, fp16 or fp8 (precision.py's rules), the param in fp32, fp16 or bf16.

Imported only on first use on CUDA tensors (fused_adamw._triton_kernel), so that the package
imports without Triton. Per-block moment scales are found inside the pass (a scale block lies in
one program). A per-tensor scale needs the new state's amax over the whole tensor before any
element is stored, so that rule launches the same kernel twice: once to find the new amaxes
(nothing stored), once to update and store with the scales taken from them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.core.optimizer.precision import SCALE_BLOCK, SCALED_RANGE, StepScalars

BLOCK = 4096
"""Elements per program: 16-byte vectors per thread at 8 warps; a 117M-element weight launches
about 29K programs. With the amax, one block per program measured best on Model A's shapes
(dev/bench_adamw.py, H200): 16.6 ms, against 20.2 ms for 4 blocks per program with one
reduction (no amax: 15.3 ms; torch's fused AdamW: 21.1 ms)."""

UNSCALED, ONE_SCALE, SCALE_PER_BLOCK = 0, 1, 2
NO_AMAX, ONE_AMAX, CELL_AMAXES = 0, 1, 2
CELL_GROUP = 128
"""Consecutive elements reduced to one atomic max of a cell amax (`AmaxCells`): a divisor of
BLOCK and of the 128-element block edge."""


@triton.jit
def _load_moment(ptr, scale_ptr, offsets, mask, SCALING: tl.constexpr, QBLOCK: tl.constexpr):
    value = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALING == 1:
        value = value * tl.load(scale_ptr)
    if SCALING == 2:
        value = value * tl.load(scale_ptr + offsets // QBLOCK, mask=mask, other=0.0)
    return value


@triton.jit
def _store_moment(
    ptr,
    scale_ptr,
    inverse_ptr,
    value,
    offsets,
    mask,
    numel,
    SCALING: tl.constexpr,
    RANGE: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if SCALING == 0:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)
    if SCALING == 1:
        scaled = value * tl.load(inverse_ptr)
        scaled = tl.minimum(tl.maximum(scaled, -RANGE), RANGE)
        tl.store(ptr + offsets, scaled.to(ptr.dtype.element_ty), mask=mask)
    if SCALING == 2:
        # Masked lanes hold 0 (every input loaded as 0), so they leave each block's amax alone.
        blocks = tl.reshape(value, (BLOCK // QBLOCK, QBLOCK))
        scale = tl.div_rn(tl.max(tl.abs(blocks), axis=1), RANGE)
        inverse = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
        scaled = tl.minimum(tl.maximum(blocks * inverse[:, None], -RANGE), RANGE)
        tl.store(ptr + offsets, tl.reshape(scaled, (BLOCK,)).to(ptr.dtype.element_ty), mask=mask)
        first = tl.program_id(0).to(tl.int64) * (BLOCK // QBLOCK)
        block_ids = first + tl.arange(0, BLOCK // QBLOCK)
        tl.store(scale_ptr + block_ids, scale, mask=block_ids * QBLOCK < numel)


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    exp_avg_scale_ptr,
    exp_avg_sq_scale_ptr,
    work_ptr,
    grad_scale_ptr,
    amax_ptr,
    numel,
    cols,
    cell_rows,
    cell_cols,
    grid_cols,
    cell_start,
    decay_factor,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    M_SCALING: tl.constexpr,
    V_SCALING: tl.constexpr,
    M_RANGE: tl.constexpr,
    V_RANGE: tl.constexpr,
    WRITE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    AMAX: tl.constexpr,
    QBLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg = _load_moment(exp_avg_ptr, exp_avg_scale_ptr, offsets, mask, M_SCALING, QBLOCK)
    exp_avg_sq = _load_moment(
        exp_avg_sq_ptr, exp_avg_sq_scale_ptr, offsets, mask, V_SCALING, QBLOCK
    )
    if HAS_GRAD_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    # The order of torch's fused AdamW (decoupled decay first, then the moments).
    # 1 - beta comes from the host (rounded from float64 as torch rounds the scalar), not
    # computed in fp32 here: 1 - 0.9f is 2 ulps off 0.1f.
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    if WRITE:
        param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * decay_factor
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = (param - step_size * exp_avg / denom).to(param_ptr.dtype.element_ty)
        tl.store(param_ptr + offsets, param, mask=mask)
        # work: [amax, amax, inverse scale of exp_avg, of exp_avg_sq] (per-tensor rules).
        _store_moment(
            exp_avg_ptr,
            exp_avg_scale_ptr,
            work_ptr + 2,
            exp_avg,
            offsets,
            mask,
            numel,
            M_SCALING,
            M_RANGE,
            QBLOCK,
            BLOCK,
        )
        _store_moment(
            exp_avg_sq_ptr,
            exp_avg_sq_scale_ptr,
            work_ptr + 3,
            exp_avg_sq,
            offsets,
            mask,
            numel,
            V_SCALING,
            V_RANGE,
            QBLOCK,
            BLOCK,
        )
        if AMAX != 0:
            # |param| >= 0, so the float max orders like the bits; masked lanes contribute 0.
            stored = tl.where(mask, tl.abs(param.to(tl.float32)), 0.0)
            if AMAX == 1:
                tl.atomic_max(amax_ptr, tl.max(stored, axis=0))
            if AMAX == 2:
                _cell_amaxes(amax_ptr, stored, numel, cols, cell_rows, cell_cols, grid_cols,
                             cell_start, BLOCK, GROUP)  # fmt: skip
    else:
        if M_SCALING == 1:
            tl.atomic_max(work_ptr, tl.max(tl.abs(exp_avg), axis=0))
        if V_SCALING == 1:
            tl.atomic_max(work_ptr + 1, tl.max(tl.abs(exp_avg_sq), axis=0))


@triton.jit
def _cell_amaxes(
    cells_bits_ptr, stored, numel, cols, cell_rows, cell_cols, grid_cols, cell_start,
    BLOCK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """Raise each scale cell's amax (int32 fp32 bits) to the max of `stored` (|updated
    param|, 0 on masked lanes) over its elements: GROUP consecutive elements lie in one cell
    (`AmaxCells.groups_in_one_cell`), so each group is one atomic max. NaN is skipped as the
    piece kernel skips it (a NaN group, like a zero one, adds nothing)."""
    groups = tl.max(tl.reshape(stored, (BLOCK // GROUP, GROUP)), axis=1)
    local = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK // GROUP) * GROUP
    first = cell_start + local  # the group's first element in the weight
    row = first // cols
    cell = (row // cell_rows) * grid_cols + (first - row * cols) // cell_cols
    valid = (local < numel) & (groups > 0)
    tl.atomic_max(
        cells_bits_ptr + cell, groups.to(tl.int32, bitcast=True), mask=valid, sem="relaxed"
    )


def _amax_launch(amax) -> tuple[int, torch.Tensor | None, dict]:
    """(mode, pointer, geometry) of an amax target: none, a 0-d tensor, or AmaxCells."""
    geometry = dict(cols=1, cell_rows=1, cell_cols=1, grid_cols=1, cell_start=0)
    if amax is None:
        return NO_AMAX, None, geometry
    if isinstance(amax, torch.Tensor):
        return ONE_AMAX, amax, geometry
    geometry.update(cols=amax.cols, cell_rows=amax.cell_rows, cell_cols=amax.cell_cols)
    geometry.update(grid_cols=amax.grid_cols, cell_start=amax.start)
    return CELL_AMAXES, amax.cells.view(torch.int32), geometry


def _scaling(data: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, float]:
    if scale is None:
        return UNSCALED, 1.0
    return (ONE_SCALE if scale.numel() == 1 else SCALE_PER_BLOCK), SCALED_RANGE[data.dtype]


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor | None,
    exp_avg_sq_scale: torch.Tensor | None,
    scalars: StepScalars,
    grad_scale: torch.Tensor | None,
    amax,
) -> None:
    """One AdamW update of a contiguous CUDA param and its moments in place (precision.
    adamw_update_'s math); `amax` (a 0-d fp32 tensor) is raised to max |updated param|, or
    (`fused_adamw.AmaxCells` whose groups lie in one cell) each cell to its elements' max."""
    numel = param.numel()
    if numel == 0:
        return
    amax_mode, amax_ptr, geometry = _amax_launch(amax)
    m_scaling, m_range = _scaling(exp_avg, exp_avg_scale)
    v_scaling, v_range = _scaling(exp_avg_sq, exp_avg_sq_scale)
    per_tensor = [i for i, s in enumerate((m_scaling, v_scaling)) if s == ONE_SCALE]
    # Scratch of the per-tensor rule only; elsewhere the kernel never reads its pointer.
    work = torch.zeros(4, dtype=torch.float32, device=param.device) if per_tensor else param
    launch = dict(
        numel=numel,
        **geometry,
        decay_factor=scalars.decay_factor,
        beta1=scalars.beta1,
        beta2=scalars.beta2,
        one_minus_beta1=1.0 - scalars.beta1,
        one_minus_beta2=1.0 - scalars.beta2,
        eps=scalars.eps,
        step_size=scalars.step_size,
        bias_correction2_sqrt=scalars.bias_correction2_sqrt,
        M_SCALING=m_scaling,
        V_SCALING=v_scaling,
        M_RANGE=m_range,
        V_RANGE=v_range,
        HAS_GRAD_SCALE=grad_scale is not None,
        AMAX=amax_mode,
        QBLOCK=SCALE_BLOCK,
        GROUP=CELL_GROUP,
        BLOCK=BLOCK,
        num_warps=8,
    )
    pointers = (
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        exp_avg_scale if exp_avg_scale is not None else work,
        exp_avg_sq_scale if exp_avg_sq_scale is not None else work,
        work,
        grad_scale if grad_scale is not None else work,
        amax_ptr if amax_ptr is not None else work,
    )
    grid = (triton.cdiv(numel, BLOCK),)
    with torch.cuda.device(param.device):
        if per_tensor:
            _adamw_kernel[grid](*pointers, WRITE=False, **launch)
            # precision.quantize_'s rule: scale = amax / range in fp32.
            new_scales = torch.stack([work[0] / m_range, work[1] / v_range])
            # The inverse the torch path uses: 1 / scale, and 0 where the scale is 0.
            work[2:] = torch.where(new_scales > 0, 1.0 / new_scales, torch.zeros_like(new_scales))
        _adamw_kernel[grid](*pointers, WRITE=True, **launch)
    for index in per_tensor:
        (exp_avg_scale, exp_avg_sq_scale)[index].copy_(new_scales[index].reshape(1))
