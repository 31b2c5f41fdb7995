"""The reference backend (pure PyTorch, any device) of the interface `quantization.backend_for`
chooses between it and `cuda.linear_ops`: `quantize_parts`, `quantize_operands`,
`weight_operand`, `gemm`.

`quantize_operands` returns (rowwise operand [M, K], transposed operand [K, M]) as
`Fp8Operand`s (FP8_NUMERICS.md, "Which copy each GEMM reads"). `gemm` emulates exactly in fp32,
or calls `cuda.scaled_mm` where the hardware takes the recipe (sm_89+ per tensor, sm_90
blockwise, sm_100+ mxfp8). Under torch.compile both are opaque custom ops
(`megatron_fp8::quantize_operands_reference`, `::gemm_reference`): QuantizedTensor is not
traceable (each construction was a graph break), and the values equal eager's.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda.gemm import scaled_mm
from megatron.core.fp8.formats import E5M2
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import quantize_reference as quantize_parts
from megatron.core.fp8.reference import scale_grid_shape

__all__ = ["emulation_dtype", "gemm", "quantize_operands", "quantize_parts", "weight_operand"]


def emulation_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The reference GEMM dequantizes in fp32 itself; operands stay FP8 bytes."""
    return torch.float32


def quantize_operands(
    x2d: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    transposed: bool,
    power_2_scale: bool,
    scale: torch.Tensor | None = None,
    amax_history: torch.Tensor | None = None,
    dequant_dtype: torch.dtype | None = None,
    saved: bool | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[Fp8Operand | None, Fp8Operand | None]:
    """(rowwise operand, transposed operand) of a 2-D tensor, each None when not asked for;
    the arguments mean what they mean for `linear_ops.quantize_operands` (dequant_dtype and
    saved are not used: every operand here is FP8 bytes). delayed: max|x| is maxed into
    `amax_history[0]` when the history is given; tensorwise: a given `amax` sets the scale."""
    spec = recipe_spec(recipe)
    given = scale if spec.delayed else amax if spec.accepts_global_amax else None
    history = amax_history if spec.delayed else None  # only delayed records
    args = (x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, given, history)
    if torch.compiler.is_compiling():
        row_data, row_scale, t_data, t_scale = _quantize_operands_op(*args)
    else:
        row_data, row_scale, t_data, t_scale = _quantize_operands(*args)
    cell = spec.block_shape(role, columnwise=False) or (0, 0)
    # Both operands contract over their last dim in cells of the rowwise shape (a columnwise
    # Bx1 copy, transposed, has 1xB cells).
    row = Fp8Operand(row_data.view(fp8_dtype), row_scale, recipe, *cell) if rowwise else None
    col = Fp8Operand(t_data.view(fp8_dtype), t_scale, recipe, *cell) if transposed else None
    return row, col


def _quantize_operands(
    x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, given, amax_history
):
    spec = recipe_spec(recipe)
    parts = quantize_parts(
        x2d,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        # The transposed operand of per-tensor and 128x128 cells is the rowwise bytes'.
        rowwise=rowwise or (transposed and spec.transposes_rowwise(role)),
        columnwise=transposed and spec.columnwise_copy(role),
        scale=given,  # delayed reads `given` as its scale, tensorwise as its amax
        amax=given,
        power_2_scale=power_2_scale,
    )
    meta = dict(shape=x2d.shape, dtype=x2d.dtype, recipe=recipe, fp8_dtype=fp8_dtype, role=role)
    qt = QuantizedTensor(**meta, **parts)
    if amax_history is not None:
        amax_history[0] = torch.maximum(amax_history[0], qt.amax.to(amax_history.dtype))
    row = qt.gemm_operand("rowwise") if rowwise else None
    col = qt.gemm_operand("columnwise") if transposed else None
    outputs = []
    for operand in (row, col):
        pair = (operand.data.view(torch.uint8), operand.scale_inv) if operand else (None, None)
        outputs += [x2d.new_empty(0, dtype=torch.uint8) if t is None else t for t in pair]
    return _distinct(outputs)


def _distinct(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors, each copied that shares storage with an earlier one: a custom op's outputs
    may not alias each other, and a transposed operand can be a view of the rowwise one (the
    per-tensor scale; a transpose that `.contiguous()` leaves a view, as of a one-block grid)."""
    seen: set[int] = set()
    result = []
    for tensor in tensors:
        if tensor.untyped_storage().nbytes() and tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        if tensor.untyped_storage().nbytes():
            seen.add(tensor.untyped_storage().data_ptr())
        result.append(tensor)
    return tuple(result)


@torch.library.custom_op(
    "megatron_fp8::quantize_operands_reference", mutates_args=("amax_history",)
)
def _quantize_operands_op(
    x2d: torch.Tensor,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    transposed: bool,
    power_2_scale: bool,
    given: torch.Tensor | None,
    amax_history: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_operands(
        x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, given, amax_history
    )


@_quantize_operands_op.register_fake
def _(x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, given, amax_history):
    rows, cols = x2d.shape

    def operand(r: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        grid = scale_grid_shape(r, c, recipe=recipe, role=role, columnwise=False)
        scale_dtype = recipe_spec(recipe).scale_dtype
        return x2d.new_empty((r, c), dtype=torch.uint8), x2d.new_empty(grid, dtype=scale_dtype)

    empty = x2d.new_empty(0, dtype=torch.uint8)
    row = operand(rows, cols) if rowwise else (empty, empty)
    col = operand(cols, rows) if transposed else (empty, empty)
    return (*row, *col)


def weight_operand(weight, usage: str, *, compute_dtype: torch.dtype) -> Fp8Operand:
    """An FP8 parameter's operand: "rowwise" (fprop) or "columnwise" (its [K, N] transpose)."""
    return weight.gemm_operand(usage)


def gemm(
    a: Fp8Operand, b: Fp8Operand, *, recipe: str, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """[rows_a, rows_b] = A B^T, both contracted over their last dim (module docstring);
    under torch.compile the custom op megatron_fp8::gemm_reference."""
    if not torch.compiler.is_compiling():
        return _gemm_eager(a, b, fast_accum=fast_accum, out_dtype=out_dtype)
    cells = [a.block_rows, a.block_cols, b.block_rows, b.block_cols]
    return _gemm_op(a.data, a.scale_inv, b.data, b.scale_inv, recipe, cells, out_dtype, fast_accum)


@torch.library.custom_op("megatron_fp8::gemm_reference", mutates_args=())
def _gemm_op(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    recipe: str,
    cells: list[int],
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`gemm` of two operands given as tensors; cells: (rows, cols) of a's then b's block."""
    a = Fp8Operand(a_data, a_scale_inv, recipe, cells[0], cells[1])
    b = Fp8Operand(b_data, b_scale_inv, recipe, cells[2], cells[3])
    return _gemm_eager(a, b, fast_accum=fast_accum, out_dtype=out_dtype).contiguous()


@_gemm_op.register_fake
def _(a_data, a_scale_inv, b_data, b_scale_inv, recipe, cells, out_dtype, fast_accum):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def _gemm_eager(a: Fp8Operand, b: Fp8Operand, *, fast_accum: bool, out_dtype) -> torch.Tensor:
    _check(a, b, fast_accum)
    device = a.data.device
    if device.type == "cuda" and a.spec.hardware_gemm(torch.cuda.get_device_capability(device)):
        return scaled_mm(
            a.data,
            b.data,
            a_scale_inv=a.scale_inv,
            b_scale_inv=b.scale_inv,
            recipe=a.recipe,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _check(a: Fp8Operand, b: Fp8Operand, fast_accum: bool) -> None:
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
    if fast_accum and not a.spec.fast_accumulation:
        raise ValueError(f"{a.recipe} GEMMs use split accumulation; pass accumulate='split'")
