"""The fused CUDA backend (`quantization.backend_for`, same interface as `reference_ops`):
GEMM-ready FP8 operands for Fp8Linear, one fused quantize pass per tensor, in
torch._scaled_mm's layout (docs/FP8_NUMERICS.md, "The operands `cuda/linear_ops.py` writes"),
so no `.t().contiguous()` and no host sync happens in a step. Delayed scaling records max|x|
inside the cast kernel (atomic max on fp32 bits into history slot 0). MXFP8 has no GEMM on
sm_90: the kernel writes dequantized values for a bf16 GEMM with fp32 accumulation; copies
kept for backward stay bytes and scales, dequantized by the GEMM that reads them.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda import quantize_blockwise as qbw
from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda import quantize_mxfp8 as qmx
from megatron.core.fp8.cuda import quantize_per_tensor as qpt
from megatron.core.fp8.cuda.gemm import blockwise_gemm_path, scaled_mm
from megatron.core.fp8.cuda.launch import LaunchSite, aligned_16, ceil_div
from megatron.core.fp8.cuda.quantize import quantize_cuda as quantize_parts  # noqa: F401
from megatron.core.fp8.debug import DEBUG
from megatron.core.fp8.quantized_tensor import Fp8Operand
from megatron.core.fp8.recipe import BLOCK_128, MX_BLOCK, recipe_spec


def available(x: torch.Tensor) -> bool:
    """Whether the fused path runs for x (a CUDA tensor and importable Triton kernels)."""
    return qc.use_triton(x)


def emulation_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """Dequantized MXFP8 values are exact in bf16 (8 bits of precision hold E4M3/E5M2's 4 and
    3, same exponent range as fp32); other inputs keep fp32 so that nothing is rounded."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


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
    """(rowwise operand, transposed operand) of a 2-D tensor, each None when not asked for; the
    bytes equal `quantize(...)`'s exactly.

    delayed: `scale` is the current 0-d scale; `amax_history` (fp32, contiguous), when given, gets
    max|x| atomically maxed into slot 0. tensorwise: the amax pass writes partial maxima that the
    cast kernel reduces; `amax`, when given (max|x|, NaN ignored, 0-d of x's dtype or fp32),
    skips it, and under torch.compile it comes from the graph (`producer_amax`, fused by Inductor
    into x's producer). mxfp8: dequantized values in `dequant_dtype` (default `emulation_dtype`),
    except a transposed copy `saved` for backward (default: for inputs and weights), which stays
    bytes with E8M0 scale_inv. Launches are prepared once per (recipe, role, outputs, shape,
    dtype, device) (`OperandPlan`): a step's call costs its allocations and launches.
    """
    x2d = x2d.contiguous()
    if x2d.numel() == 0:
        raise ValueError("Fp8Linear cannot quantize an empty tensor")
    spec = recipe_spec(recipe)
    if spec.delayed and (scale is None or scale.dtype != torch.float32):
        raise ValueError("recipe='delayed' quantizes with the current 0-d fp32 scale: pass scale=")
    if not spec.delayed:
        scale = amax_history = None  # only the delayed recipe reads a scale or records
    if not spec.per_tensor or spec.delayed:
        amax = None  # only tensorwise scales from this pass's amax
    elif amax is None and DEBUG.amax_in_graph and torch.compiler.is_compiling():
        amax = producer_amax(x2d)
    elif amax is not None and (amax.dim() or not amax.dtype.is_floating_point):
        raise ValueError(f"amax= is max|x| as a 0-d float tensor, got {amax.dtype} {amax.shape}")
    # Only emulated MXFP8 writes dequantized values; other recipes' plans ignore the dtype.
    dequant_dtype = (
        (dequant_dtype or emulation_dtype(x2d.dtype)) if spec.fused_linear_emulates else None
    )
    settings = (recipe, fp8_dtype, role, rowwise, transposed, power_2_scale)
    if saved is None:
        saved = role != "grad"
    # Only emulated MXFP8 keeps bytes where values would do; other plans share one key.
    saved = bool(saved and transposed and spec.fused_linear_emulates)
    key = _plan_key(
        x2d,
        settings,
        record=amax_history is not None,
        amax_dtype=amax.dtype if amax is not None else None,
        dequant_dtype=dequant_dtype,
        saved=saved,
    )
    if torch.compiler.is_compiling():
        if amax_history is not None:
            return _recording_operands(x2d, settings, scale, amax_history)
        # Traced: no data pointers read and no global cache written; every launch goes
        # through Triton's own call, which torch.compile traces (launch.LaunchSite).
        return OperandPlan(*key)(x2d, scale, amax_history, aligned=_alignment_unread, amax=amax)
    return _planned(key, x2d, scale, amax_history, amax)


def producer_amax(x2d: torch.Tensor) -> torch.Tensor:
    """max|x| of a 2-D tensor, NaN ignored, as a 0-d tensor of x's dtype, in torch ops that
    Inductor computes in x's producer's kernel (row maxima over a norm's rows or a pointwise
    output). Exact even where Inductor takes the maxima of the fp32 values before rounding to x's
    dtype: round-to-nearest is monotonic and odd, and the row maxima are stored in x's dtype."""
    magnitude = x2d.abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude)
    return magnitude.amax(dim=-1).amax()


def _plan_key(
    x2d, settings: tuple, *, record: bool, amax_dtype, dequant_dtype, saved: bool
) -> tuple:
    """The `_plans` key: settings (recipe, fp8_dtype, role, rowwise, transposed,
    power_2_scale), then x2d's shape, dtype and device, whether it records, the dtype of the
    amax the caller gives (None: none; the cast kernel is specialized on it), dequant_dtype,
    whether the transposed copy is kept as bytes."""
    return (*settings, x2d.shape, x2d.dtype, x2d.device, record, amax_dtype, dequant_dtype, saved)


def _planned(key: tuple, x2d, scale, amax_history, amax=None):
    """The kept plan of `key` (made on first use) run eagerly on x2d."""
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= DEBUG.max_plans:
            _plans.clear()  # many token counts (e.g. varying sequence lengths): start over
        plan = _plans[key] = OperandPlan(*key)
    return plan(x2d, scale, amax_history, amax=amax)


def _recording_operands(x2d, settings: tuple, scale, amax_history):
    """Delayed scaling's quantization under torch.compile: the custom op
    `megatron_fp8::quantize_operands_recording`, which declares the amax history it writes.
    After a flush each history is a row of one stacked tensor; traced, the Triton launch's write
    into such a row did not reach the stacked tensor (H200:
    `test_compiled_delayed_recording_equals_eager_with_stacked_histories` with this op bypassed).
    A declared mutation is functionalized with the row's base, and the records equal eager's."""
    fp8_dtype, rowwise, transposed = settings[1], settings[3], settings[4]
    data, data_t, scale_inv = _recording_op(x2d, *settings, scale, amax_history)
    row = Fp8Operand(data.view(fp8_dtype), scale_inv) if rowwise else None
    col = Fp8Operand(data_t.view(fp8_dtype), scale_inv) if transposed else None
    return row, col


@torch.library.custom_op(
    "megatron_fp8::quantize_operands_recording", mutates_args=("amax_history",)
)
def _recording_op(
    x2d: torch.Tensor,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    transposed: bool,
    power_2_scale: bool,
    scale: torch.Tensor,
    amax_history: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rowwise bytes, transposed bytes, scale_inv) as uint8, uint8 and 0-d fp32; a copy not
    asked for is an empty tensor. Per-tensor recipes only (the ones that record). Runs the
    kept plan eagerly (what the compiled graph calls at run time)."""
    settings = (recipe, fp8_dtype, role, rowwise, transposed, power_2_scale)
    key = _plan_key(x2d, settings, record=True, amax_dtype=None, dequant_dtype=None, saved=False)
    row, col = _planned(key, x2d.contiguous(), scale, amax_history)
    empty = x2d.new_empty(0, dtype=torch.uint8)
    data = row.data.view(torch.uint8) if row is not None else empty
    data_t = col.data.view(torch.uint8) if col is not None else empty
    return data, data_t, (row or col).scale_inv


@_recording_op.register_fake
def _(x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, scale, amax_history):
    rows, cols = x2d.shape
    empty = x2d.new_empty(0, dtype=torch.uint8)
    data = x2d.new_empty((rows, cols), dtype=torch.uint8) if rowwise else empty
    data_t = x2d.new_empty((cols, rows), dtype=torch.uint8) if transposed else empty
    return data, data_t, x2d.new_empty((), dtype=torch.float32)


# (recipe, fp8_dtype, role, rowwise, transposed, power_2_scale, shape, dtype, device, record,
# amax_dtype, dequant_dtype, saved) -> OperandPlan
_plans: dict[tuple, OperandPlan] = {}
# A plan is small, but one is kept per token count: bounded (`DEBUG.max_plans`) for runs whose
# shapes vary.


def clear_plans() -> None:
    """Forget the prepared launches, e.g. after changing `quantize.TILE_CONFIG` (a plan keeps
    the launch configuration it was built with)."""
    _plans.clear()


def _alignment_unread(t: torch.Tensor) -> None:
    return None


class OperandPlan:
    """The launches of `quantize_operands` for one (recipe, role, outputs, shape, dtype,
    device): grids and constexprs computed once, kernels held by `launch.LaunchSite`s. What a
    call may vary is which of the caller's tensors are 16-byte aligned (outputs allocated
    here always are), the alignment key of the sites."""

    def __init__(
        self,
        recipe,
        fp8_dtype,
        role,
        rowwise,
        transposed,
        power_2_scale,
        shape,
        dtype,
        device,
        record,
        amax_dtype,
        dequant_dtype,
        saved,
    ) -> None:
        self.recipe, self.fp8_dtype = recipe, fp8_dtype
        self.rowwise, self.transposed = rowwise, transposed
        self.rows, self.cols = shape
        self.device, self.dequant_dtype = device, dequant_dtype
        spec = recipe_spec(recipe)
        options = dict(fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, input_dtype=dtype)
        if spec.per_tensor:
            self._plan_per_tensor(spec, record=record, amax_dtype=amax_dtype, **options)
        elif spec.uses_2d_blocks(role):
            self.cast = LaunchSite(
                *qbw.block_128x128_spec(
                    self.rows,
                    self.cols,
                    write_row=rowwise,
                    write_t=transposed,
                    record=False,
                    **options,
                )
            )
            self.run = self._block_128x128
        elif not spec.fused_linear_emulates:  # blockwise 1x128 activations and grads
            self._plan_block_1x128(**options)
        else:
            self._plan_mxfp8(saved)

    def _plan_per_tensor(self, spec, *, record, amax_dtype, **options) -> None:
        rows, cols = self.rows, self.cols
        partials = 0
        if not spec.delayed and amax_dtype is None:  # tensorwise: scale from this pass's amax
            kernel, grid, constexprs, self.blocks_per_program = qpt.amax_partials_spec(rows * cols)
            self.amax = LaunchSite(kernel, grid, constexprs)
            partials = grid[0]
        self.partials = partials
        self.cast = LaunchSite(
            *qpt.per_tensor_cast_spec(
                rows,
                cols,
                write_row=self.rowwise,
                write_t=self.transposed,
                record=record,
                recipe=self.recipe,
                amax_partials=partials,
                **options,
            )
        )
        self.run = self._per_tensor

    def _plan_block_1x128(self, **options) -> None:
        rows, cols, rowwise, transposed = self.rows, self.cols, self.rowwise, self.transposed
        fused = None
        if rowwise and transposed:
            fused = qbw.block_1x128_fused_spec(
                rows,
                cols,
                columnwise=False,
                write_t=True,
                record=False,
                row_scale_t=True,
                **options,
            )
        self.fused_site = LaunchSite(*fused) if fused is not None else None
        if rowwise and fused is None:
            self.rows_site = LaunchSite(
                *qbw.block_1x128_rows_spec(rows, cols, record=False, row_scale_t=True, **options)
            )
        if transposed and fused is None:
            self.cols_site = LaunchSite(
                *qbw.block_128x1_cols_spec(
                    rows, cols, columnwise=False, write_t=True, record=False, **options
                )
            )
        self.run = self._block_1x128

    def _plan_mxfp8(self, saved: bool) -> None:
        """mxfp8, emulated GEMM: dequantized values, or bytes where they are kept. A transposed
        copy saved for backward (an input's or a weight's in the forward) is kept as bytes and
        E8M0 scales (half the bytes of bf16 values), dequantized by the GEMM that reads them.
        Everything else is read at once: dequantized values, one pass."""
        rows, cols = self.rows, self.cols
        self.keeps_bytes = saved  # the key's: only ever True for a transposed copy
        values = dict(write_t=False, record=False, fp8_dtype=self.fp8_dtype)
        self.cast = self.col_cast = None
        col_values = self.transposed and not self.keeps_bytes
        if self.rowwise or col_values:
            self.cast = LaunchSite(
                *qmx.mxfp8_spec(
                    rows, cols, rowwise=self.rowwise, columnwise=col_values, dequant=True, **values
                )
            )
        if self.keeps_bytes:
            self.col_cast = LaunchSite(
                *qmx.mxfp8_spec(rows, cols, rowwise=False, columnwise=True, dequant=False, **values)
            )
        self.run = self._mxfp8

    def __call__(self, x2d, scale, amax_history, aligned=None, amax=None):
        """`aligned(t)`: the alignment key part of a caller tensor (default: whether it is
        16-byte aligned). `amax`: tensorwise max|x| from the caller (a plan made with
        an amax_dtype), else None."""
        return self.run(x2d, scale, amax_history, aligned or aligned_16, amax)

    def _empty(self, rows: int, cols: int, dtype=torch.uint8) -> torch.Tensor:
        return torch.empty((rows, cols), dtype=dtype, device=self.device)

    def _per_tensor(self, x2d, scale, amax_history, aligned, amax):
        rows, cols = self.rows, self.cols
        x_aligned = aligned(x2d)
        if self.partials:
            amax = torch.empty(self.partials, dtype=torch.float32, device=self.device)
            self.amax((x2d, amax, rows * cols, self.blocks_per_program), x_aligned)
        data = self._empty(rows, cols) if self.rowwise else None
        data_t = self._empty(cols, rows) if self.transposed else None
        scale_inv = torch.empty((), dtype=torch.float32, device=self.device)
        record = amax_history.view(torch.int32) if amax_history is not None else None
        args = qpt.per_tensor_cast_args(x2d, data, data_t, scale, amax, scale_inv, record)
        # Which caller tensors are aligned: x, the scale or amax, the amax history.
        alignment = (x_aligned, aligned(args[3]), record is None or aligned(record))
        self.cast(args, alignment)
        row = Fp8Operand(data.view(self.fp8_dtype), scale_inv) if data is not None else None
        col = Fp8Operand(data_t.view(self.fp8_dtype), scale_inv) if data_t is not None else None
        return row, col

    def _block_1x128(self, x2d, scale, amax_history, aligned, amax):
        rows, cols = self.rows, self.cols
        row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
        x_aligned = aligned(x2d)
        row_op = col_op = None
        if self.rowwise:
            row = self._empty(rows, cols)
            # Stored [K/128, M]: its .t() is the (M, K/128) outer-dim-major grid cuBLAS reads.
            row_sinv_t = self._empty(col_blocks, rows, torch.float32)
            if self.fused_site is None:
                self.rows_site((x2d, row, row_sinv_t, row_sinv_t, rows, cols), x_aligned)
            row_op = Fp8Operand(row.view(self.fp8_dtype), row_sinv_t.t())
        if self.transposed:
            col_t = self._empty(cols, rows)
            col_sinv = self._empty(row_blocks, cols, torch.float32)
            if self.fused_site is None:
                self.cols_site((x2d, col_t, col_sinv, col_t, col_sinv, rows, cols), x_aligned)
            else:
                args = (x2d, row, row_sinv_t, col_t, col_sinv, col_t, row_sinv_t, rows, cols)
                self.fused_site(args, x_aligned)
            # The transposed operand [K, M] has 1x128 blocks along M: grid (K, M/128).
            col_op = Fp8Operand(col_t.view(self.fp8_dtype), col_sinv.t())
        return row_op, col_op

    def _block_128x128(self, x2d, scale, amax_history, aligned, amax):
        rows, cols = self.rows, self.cols
        row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
        data = self._empty(rows, cols) if self.rowwise else None
        scale_inv = self._empty(row_blocks, col_blocks, torch.float32)
        data_t = self._empty(cols, rows) if self.transposed else None
        scale_inv_t = (
            self._empty(col_blocks, row_blocks, torch.float32) if self.transposed else None
        )
        args = qbw.block_128x128_args(x2d, data, scale_inv, data_t, scale_inv_t, None)
        self.cast(args, aligned(x2d))
        row_op = Fp8Operand(data.view(self.fp8_dtype), scale_inv) if data is not None else None
        col_op = None
        if data_t is not None:
            col_op = Fp8Operand(data_t.view(self.fp8_dtype), scale_inv_t)
        return row_op, col_op

    def _mxfp8(self, x2d, scale, amax_history, aligned, amax):
        # Ragged edges need no care: the kernel's masked loads zero-pad the blocks, as the
        # rules do.
        rows, cols = self.rows, self.cols
        row = self._empty(rows, cols, self.dequant_dtype) if self.rowwise else None
        col = col_e = None
        if self.transposed:
            col = self._empty(rows, cols, torch.uint8 if self.keeps_bytes else self.dequant_dtype)
        if self.cast is not None:
            values = None if self.keeps_bytes else col
            self.cast(qmx.mxfp8_args(x2d, row, None, values, None, None, None), aligned(x2d))
        if self.keeps_bytes:
            col_e = self._empty(ceil_div(rows, MX_BLOCK), cols)
            self.col_cast(qmx.mxfp8_args(x2d, None, None, col, col_e, None, None), aligned(x2d))
            col = col.view(self.fp8_dtype)
        # The columnwise copy keeps x's shape; the transposed operand is a view (bf16 GEMMs
        # take either layout, and the dequantizing GEMM reads the bytes in x's layout).
        return (
            Fp8Operand(row, None) if row is not None else None,
            Fp8Operand(col.t(), col_e) if col is not None else None,
        )


def weight_operand(weight, usage: str, *, compute_dtype: torch.dtype) -> Fp8Operand:
    """The operand of an FP8 parameter (a QuantizedTensor): "rowwise" for fprop, "columnwise"
    (the [K, N] transpose) for dgrad. MXFP8 bytes go through the fused dequantize kernel."""
    if not weight.spec.fused_linear_emulates:
        return weight.gemm_operand(usage)
    columnwise = usage == "columnwise"
    data = weight.columnwise_data if columnwise else weight.rowwise_data
    scale_inv = weight.columnwise_scale_inv if columnwise else weight.rowwise_scale_inv
    if data is None:
        raise ValueError(f"the FP8 mxfp8 weight has no {usage} copy; quantize it with both")
    values = qmx.mxfp8_dequantize(
        data.reshape(-1, weight.shape[-1]),
        scale_inv,
        fp8_dtype=weight.fp8_dtype,
        columnwise=columnwise,
        out_dtype=compute_dtype,
    )
    return Fp8Operand(values.t() if columnwise else values, None)


def gemm(
    a: Fp8Operand, b: Fp8Operand, *, recipe: str, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """[rows_a, rows_b] = A B^T, both contracted over their last dim.

    Under torch.compile the GEMM is the custom op `megatron_fp8::gemm`: opaque to the
    compiler, which neither traces our checks and padding nor lowers torch._scaled_mm itself
    (Inductor's lowering refuses blockwise scale grids with symbolic shapes), and fuses the
    model's elementwise code around it. Eager calls skip the op's dispatch (a few us each)."""
    if torch.compiler.is_compiling():
        return _gemm_op(a.data, a.scale_inv, b.data, b.scale_inv, recipe, out_dtype, fast_accum)
    return _gemm_eager(a, b, recipe=recipe, out_dtype=out_dtype, fast_accum=fast_accum)


@torch.library.custom_op("megatron_fp8::gemm", mutates_args=())
def _gemm_op(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor | None,
    recipe: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    return _gemm_eager(
        Fp8Operand(a_data, a_scale_inv),
        Fp8Operand(b_data, b_scale_inv),
        recipe=recipe,
        out_dtype=out_dtype,
        fast_accum=fast_accum,
    )


@_gemm_op.register_fake
def _(a_data, a_scale_inv, b_data, b_scale_inv, recipe, out_dtype, fast_accum):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def _gemm_eager(
    a: Fp8Operand, b: Fp8Operand, *, recipe: str, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    if recipe_spec(recipe).fused_linear_emulates:
        a_values, b_values = _mx_values(a, b.data.dtype), _mx_values(b, a.data.dtype)
        product = torch.mm(a_values, b_values.t())
        return product if product.dtype == out_dtype else product.to(out_dtype)
    direct = _direct_scaled_mm(a, b, recipe=recipe, out_dtype=out_dtype, fast_accum=fast_accum)
    if direct is not None:
        return direct
    return scaled_mm(
        a.data,
        b.data,
        a_scale_inv=a.scale_inv,
        b_scale_inv=b.scale_inv,
        recipe=recipe,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _mx_values(operand: Fp8Operand, compute_dtype: torch.dtype) -> torch.Tensor:
    """An emulated MXFP8 operand's values: as they are, or, for kept bytes (the transposed
    view of 32x1-block columnwise bytes, `OperandPlan._mxfp8`), dequantized now in the
    dtype of the GEMM's other operand, which holds values."""
    if operand.scale_inv is None:
        return operand.data
    if compute_dtype.itemsize == 1:
        raise ValueError("an emulated MXFP8 GEMM dequantizes at most one of its operands")
    columnwise = operand.data.t()
    values = qmx.mxfp8_dequantize(
        columnwise.view(torch.uint8),
        operand.scale_inv,
        fp8_dtype=columnwise.dtype,
        columnwise=True,
        out_dtype=compute_dtype,
    )
    return values.t()


def _direct_scaled_mm(a, b, *, recipe, out_dtype, fast_accum, out=None) -> torch.Tensor | None:
    """torch._scaled_mm called as `gemm.scaled_mm` would call it, without its checks and
    padding, for operands that need none: the fused kernels' outputs (row-major FP8 bytes,
    scales already in cuBLAS's layouts) with dims that are multiples of the GEMM's alignment.
    None when anything differs, and for blockwise until cuBLAS has accepted blockwise scales
    once in this process (`gemm.blockwise_gemm_path`); the caller then takes the full path."""
    x, w = a.data, b.data
    rows, k = x.shape
    n = w.shape[0]
    if k % 16 or n % 16 or not (x.is_contiguous() and w.is_contiguous()):
        return None
    sa, sb = a.scale_inv, b.scale_inv
    if not all(map(aligned_16, (x, w, sa, sb) if out is None else (x, w, sa, sb, out))):
        return None  # the general path copies operands and scales (gemm.py)
    spec = recipe_spec(recipe)
    if spec.per_tensor:
        if sa.dim() or sb.dim() or sa.dtype != torch.float32 or sb.dtype != torch.float32:
            return None
        return torch._scaled_mm(
            x, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum,
            out=out,
        )  # fmt: skip
    if spec.e8m0_scales or blockwise_gemm_path() != "torch._scaled_mm" or rows % 16:
        return None
    k_blocks = k // BLOCK_128
    # a: 1x128, (rows, K/128) outer-dim-major. b: 1x128 (n, K/128) read as its contiguous
    # transpose, or 128x128 (n/128, K/128) contiguous with K a multiple of 512 (gemm.py).
    if sa.dtype != torch.float32 or sb.dtype != torch.float32 or k % BLOCK_128:
        return None
    if sa.shape != (rows, k_blocks) or sa.stride() != (1, rows):
        return None
    b_1x128 = sb.shape == (n, k_blocks) and sb.stride() == (1, n)
    b_128x128 = sb.shape == (ceil_div(n, BLOCK_128), k_blocks) and sb.is_contiguous()
    if not (b_1x128 or (b_128x128 and k % 512 == 0)):
        return None
    try:
        return torch._scaled_mm(
            x, w.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype, use_fast_accum=False, out=out
        )  # fmt: skip
    except (RuntimeError, NotImplementedError, ValueError):
        # cuBLASLt may refuse one shape after accepting others: the general path decides
        # (it records the refusal and emulates), as it would have without this shortcut.
        return None
