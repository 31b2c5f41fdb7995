"""`quantize_cuda`: fused FP8 quantization on CUDA, with a plain-torch fallback.

The public `megatron.core.fp8.quantize(..., backend="cuda")` calls this. Triton is imported
lazily, so this module imports on machines without Triton (and without a GPU); there, and for
CPU tensors, the torch fallback in `torch_quantize.py` runs the same rules unfused.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.fp8.cuda import torch_quantize as tq
from megatron.core.fp8.cuda.formats import (
    BLOCK_128,
    MX_BLOCK,
    ROLES,
    as_2d_shape,
    ceil_div,
    check_fp8_dtype,
    fp8_max,
    fp8_max_reciprocal,
    infinite_scale_replacement,
)
from megatron.core.fp8.cuda.launch import launch
from megatron.core.fp8.recipe import recipe_spec

# Launch configurations per kernel: tile rows BM, tile cols BK, tiles per program GROUP (a
# program walks GROUP tiles down one column strip), warps; BLOCK elements per step of the amax
# pass; TRANS_X: transpose the high-precision tile rather than the FP8 bytes. Block recipes
# need the whole 128x128 (1x128 / 128x128) or 32-aligned (MX) block inside one program so that
# each block's amax finishes there. `benchmarks/bench_fp8.py --sweep` times alternatives; the
# values here are the fastest measured on an H200
# (docs/benchmarks/fp8_quantize_pair_kernel_h200_2026-12-01.md).
TILE_CONFIG: dict[str, dict[str, int]] = {
    "amax": dict(BLOCK=16384, GROUP=1, num_warps=16),
    "cast": dict(BM=64, BK=64, GROUP=4, TRANS_X=False, num_warps=4),
    "cast_t": dict(BM=64, BK=64, GROUP=4, TRANS_X=False, num_warps=4),
    "block_1x128": dict(BM=64, GROUP=1, num_warps=4),
    "block_128x1": dict(BK=64, TRANS_X=False, num_warps=4),
    # Both 1x128 copies in one launch when one is transposed: the rows and cols kernels'
    # tiles of each 128x128 tile as consecutive programs (block_1x128_pair_kernel); empty:
    # "block_1x128_fused".
    "block_1x128_pair": dict(BM=64, BK=64, TRANS_X=False, num_warps=4),
    # Both 1x128 copies from one 128x128 tile read (rows % 4 == 0): the API's columnwise copy
    # in x's shape, and the transposed one when "block_1x128_pair" is empty; empty: the two
    # single-copy kernels.
    "block_1x128_fused": dict(num_warps=4),
    "block_128x128": dict(TRANS_X=True, num_warps=4),
    "mxfp8": dict(CHUNKS=2, num_warps=1),
    "mxfp8_dequantized": dict(CHUNKS=1, num_warps=1),
    # mxfp8_quads_kernel for the two above when there is no transposed copy; empty: not used.
    "mxfp8_quads": dict(CHUNKS=4, num_warps=1),
    "mxfp8_quads_dequantized": dict(CHUNKS=1, num_warps=1),
    "mxfp8_dequant": dict(CHUNKS=2, num_warps=1),
}


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    """The Triton kernel module, or None when Triton cannot be imported here."""
    try:
        from megatron.core.fp8.cuda import triton_quantize
    except ImportError:
        return None
    return triton_quantize


def triton_available() -> bool:
    """Whether the fused Triton kernels can run (Triton importable and a CUDA device present)."""
    return torch.cuda.is_available() and _triton_kernels() is not None


def _use_triton(x: torch.Tensor, force_torch: bool) -> bool:
    return not force_torch and x.is_cuda and _triton_kernels() is not None


def quantize_cuda(
    x: torch.Tensor,
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    columnwise: bool,
    scale: torch.Tensor | None = None,
    power_2_scale: bool,
    amax: torch.Tensor | None = None,
    with_transpose: bool = False,
    force_torch: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Quantize `x` under `recipe`; returns rowwise_data, rowwise_scale_inv, columnwise_data,
    columnwise_scale_inv (None when not asked for), amax (0-d fp32, NaN ignored) and, with
    `with_transpose`, columnwise_data_t: the row-major transpose of the columnwise bytes (the
    per-tensor transpose cache, or the operand a blockwise/MX wgrad GEMM reads).

    `scale` (delayed only) is the current 0-d fp32 scale. `amax` (tensorwise only) is an
    already reduced amax: pass one is skipped. Per-tensor columnwise bytes equal the rowwise
    bytes (same shape, same scale) and are returned as the same tensor. `force_torch` runs the
    plain-torch fallback even when Triton is available (tests, debugging).
    """
    _check_args(
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=rowwise,
        columnwise=columnwise,
        scale=scale,
        amax=amax,
        with_transpose=with_transpose,
    )
    x = x.contiguous()
    rows, cols = as_2d_shape(x.shape)
    x2d = x.view(rows, cols)
    triton_path = _use_triton(x, force_torch)
    spec = recipe_spec(recipe)
    if spec.per_tensor:
        run = _per_tensor_triton if triton_path else _per_tensor_torch
        out = run(
            x2d,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            scale=scale,
            amax=amax,
            power_2_scale=power_2_scale,
            with_transpose=with_transpose,
        )
        out["columnwise_data"] = out["rowwise_data"] if columnwise else None
        out["columnwise_scale_inv"] = out["rowwise_scale_inv"] if columnwise else None
        if not rowwise:
            out["rowwise_data"] = out["rowwise_scale_inv"] = None
    elif not spec.e8m0_scales:
        run = _blockwise_triton if triton_path else _blockwise_torch
        out = run(
            x2d,
            fp8_dtype=fp8_dtype,
            weight=role == "weight",
            rowwise=rowwise,
            columnwise=columnwise,
            power_2_scale=power_2_scale,
            with_transpose=with_transpose,
        )
    else:
        run = _mxfp8_triton if triton_path else _mxfp8_torch
        out = run(
            x2d,
            fp8_dtype=fp8_dtype,
            rowwise=rowwise,
            columnwise=columnwise,
            with_transpose=with_transpose,
        )
    for key in ("rowwise_data", "columnwise_data"):
        if out[key] is not None:
            out[key] = out[key].view(x.shape)
    return out


def _check_args(
    *,
    recipe: str,
    fp8_dtype: torch.dtype,
    role: str,
    rowwise: bool,
    columnwise: bool,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    with_transpose: bool,
) -> None:
    spec = recipe_spec(recipe)  # an unknown name raises, naming the recipes
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise=True, columnwise=True")
    if with_transpose and not columnwise:
        raise ValueError("with_transpose=True transposes the columnwise copy: set columnwise=True")
    if spec.delayed and scale is None:
        raise ValueError("recipe='delayed' quantizes with the current scale: pass scale=")
    if not spec.delayed and scale is not None:
        raise ValueError(f"scale= is only for recipe='delayed', got recipe={recipe!r}")
    if not spec.accepts_global_amax and amax is not None:
        raise ValueError(f"amax= is only for recipe='tensorwise', got recipe={recipe!r}")


def _scalar_f32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.float32).reshape(())


def _whole_amax_torch(x2d: torch.Tensor) -> torch.Tensor:
    if x2d.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x2d.device)
    return tq.nan_ignoring_abs(x2d.float()).amax()


def _per_tensor_torch(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    if recipe_spec(recipe).delayed:
        amax_out = _whole_amax_torch(x2d)
        scale_used = _scalar_f32(scale, x2d.device)
    else:
        amax_out = _whole_amax_torch(x2d) if amax is None else _scalar_f32(amax, x2d.device)
        scale_used = tq.scale_from_amax(
            amax_out,
            fp8_dtype=fp8_dtype,
            inf_scale=infinite_scale_replacement(recipe=recipe, input_dtype=x2d.dtype),
            power_2_scale=power_2_scale,
        )
    data, scale_inv = tq.quantize_per_tensor(x2d, fp8_dtype=fp8_dtype, scale=scale_used)
    out = {"rowwise_data": data, "rowwise_scale_inv": scale_inv, "amax": amax_out}
    if with_transpose:
        out["columnwise_data_t"] = data.t().contiguous()
    return out


def _blockwise_torch(x2d, *, fp8_dtype, weight, rowwise, columnwise, power_2_scale, with_transpose):
    options = dict(
        fp8_dtype=fp8_dtype,
        inf_scale=infinite_scale_replacement(recipe="blockwise", input_dtype=x2d.dtype),
        power_2_scale=power_2_scale,
    )
    out = dict.fromkeys(_KEYS)
    out["amax"] = _whole_amax_torch(x2d)
    if weight:
        data, scale_inv = tq.quantize_128x128(x2d, **options)
        _fill_weight_copies(out, data, scale_inv, rowwise=rowwise, columnwise=columnwise)
    else:
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = tq.quantize_1x128(
                x2d, along_rows=True, **options
            )
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = tq.quantize_1x128(
                x2d, along_rows=False, **options
            )
    if with_transpose:
        out["columnwise_data_t"] = out["columnwise_data"].t().contiguous()
    return out


def _fill_weight_copies(out, data, scale_inv, *, rowwise, columnwise):
    """128x128 blocks: the columnwise copy has the same bytes and scale grid as the rowwise one
    (a GEMM reads its transpose through the transpose cache)."""
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = data, scale_inv
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = data, scale_inv


def _mxfp8_torch(x2d, *, fp8_dtype, rowwise, columnwise, with_transpose):
    out = dict.fromkeys(_KEYS)
    out["amax"] = _whole_amax_torch(x2d)
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = tq.quantize_mxfp8(
            x2d, fp8_dtype=fp8_dtype, along_rows=True
        )
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = tq.quantize_mxfp8(
            x2d, fp8_dtype=fp8_dtype, along_rows=False
        )
    if with_transpose:
        out["columnwise_data_t"] = out["columnwise_data"].t().contiguous()
    return out


_KEYS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _empty_u8(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.empty((rows, cols), dtype=torch.uint8, device=device)


def _amax_buffer(device: torch.device) -> torch.Tensor:
    """int32 cell for the atomic max of fp32 amax bits; 0 is the bit pattern of +0.0."""
    return torch.zeros((), dtype=torch.int32, device=device)


# At most this many partial maxima (a power of two: the cast kernel loads them as one block).
AMAX_PARTIALS = 256


def amax_partials_spec(numel: int) -> tuple:
    """(kernel, grid, constexprs, blocks per program) of the atomic-free amax pass into
    grid[0] partial maxima, grid[0] a power of two <= AMAX_PARTIALS."""
    block = TILE_CONFIG["amax"]["BLOCK"]
    blocks = ceil_div(numel, block)
    programs = min(AMAX_PARTIALS, 1 << max(blocks - 1, 0).bit_length())
    per_program = ceil_div(blocks, programs)
    constexprs = dict(
        BLOCK=block,
        EVEN=numel == programs * per_program * block,
        num_warps=TILE_CONFIG["amax"]["num_warps"],
    )
    return _triton_kernels().amax_partials_kernel, (programs,), constexprs, per_program


def launch_amax(x2d: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """Atomically max the NaN-ignoring max|x| of a contiguous tensor into int32 amax_bits."""
    config = TILE_CONFIG["amax"]
    grid = (ceil_div(x2d.numel(), config["BLOCK"] * config["GROUP"]),)
    launch(_triton_kernels().amax_kernel, grid, (x2d, amax_bits, x2d.numel()), config)


def per_tensor_cast_spec(
    rows,
    cols,
    *,
    write_row,
    write_t,
    record,
    fp8_dtype,
    recipe,
    power_2_scale,
    input_dtype,
    amax_partials=0,
) -> tuple:
    """(kernel, grid, constexprs) of the per-tensor cast of a [rows, cols] tensor;
    amax_partials: the amax argument holds that many partial maxima (tensorwise)."""
    delayed = recipe_spec(recipe).delayed
    config = TILE_CONFIG["cast_t" if write_t else "cast"]
    grid = (ceil_div(cols, config["BK"]) * ceil_div(rows, config["BM"] * config["GROUP"]),)
    constants = dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        INF_SCALE=infinite_scale_replacement(recipe=recipe, input_dtype=input_dtype),
        POW2=power_2_scale and not delayed,
        SCALE_GIVEN=delayed,
        RECORD_AMAX=record,
        WRITE_ROW=write_row,
        WRITE_T=write_t,
        **config,
        AMAX_PARTIALS=amax_partials,
    )
    return _triton_kernels().per_tensor_cast_kernel, grid, constants


def per_tensor_cast_args(x2d, data, data_t, scale, amax, scale_inv, record_bits) -> tuple:
    """The cast kernel's runtime arguments (absent outputs point at present ones, unused)."""
    placeholder = data if data is not None else data_t
    return (
        x2d,
        placeholder,
        placeholder if data_t is None else data_t,
        scale if scale is not None else amax,
        amax if amax is not None else scale,
        scale_inv,
        record_bits if record_bits is not None else scale_inv,
        x2d.shape[0],
        x2d.shape[1],
    )


def launch_per_tensor_cast(
    x2d, *, data, data_t, scale, amax, scale_inv, record_bits, fp8_dtype, recipe, power_2_scale
) -> None:
    """One read of x2d: rowwise bytes (data) and/or their [K, M] transpose (data_t).

    delayed: `scale` is the current scale; record_bits (int32 view, may be slot 0 of an amax
    history) receives max|x| by atomic max. tensorwise: the scale comes from `amax`."""
    rows, cols = x2d.shape
    delayed = recipe_spec(recipe).delayed
    kernel, grid, constants = per_tensor_cast_spec(
        rows,
        cols,
        write_row=data is not None,
        write_t=data_t is not None,
        record=record_bits is not None,
        fp8_dtype=fp8_dtype,
        recipe=recipe,
        power_2_scale=power_2_scale,
        input_dtype=x2d.dtype,
    )
    args = per_tensor_cast_args(
        x2d,
        data,
        data_t,
        scale if delayed else None,
        None if delayed else amax,
        scale_inv,
        record_bits,
    )
    launch(kernel, grid, args, constants)


def _per_tensor_triton(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = _amax_buffer(device)
    delayed = recipe_spec(recipe).delayed
    if not delayed and amax is None and x2d.numel() > 0:
        launch_amax(x2d, amax_bits)
    amax_out = amax_bits.view(torch.float32)
    if amax is not None:
        amax_out = _scalar_f32(amax, device)
    data = _empty_u8(rows, cols, device)
    data_t = _empty_u8(cols, rows, device) if with_transpose else None
    # Written by the cast kernel's first program (no fill kernel); empty inputs set it below.
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    if x2d.numel() > 0:
        launch_per_tensor_cast(
            x2d,
            data=data,
            data_t=data_t,
            scale=_scalar_f32(scale, device) if delayed else None,
            amax=None if delayed else amax_out,
            scale_inv=scale_inv,
            record_bits=amax_bits if delayed else None,
            fp8_dtype=fp8_dtype,
            recipe=recipe,
            power_2_scale=power_2_scale,
        )
    else:
        scale_inv = _per_tensor_torch(
            x2d,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            scale=scale,
            amax=amax,
            power_2_scale=power_2_scale,
            with_transpose=False,
        )["rowwise_scale_inv"]
    out = {"rowwise_data": data, "rowwise_scale_inv": scale_inv, "amax": amax_out}
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


def _block_constants(input_dtype: torch.dtype, fp8_dtype: torch.dtype, power_2_scale: bool) -> dict:
    return dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        INF_SCALE=infinite_scale_replacement(recipe="blockwise", input_dtype=input_dtype),
        POW2=power_2_scale,
        TILE=BLOCK_128,
    )


def block_128x128_spec(
    rows, cols, *, write_row, write_t, record, fp8_dtype, power_2_scale, input_dtype
) -> tuple:
    """(kernel, grid, constexprs) of the 128x128 weight-block kernel."""
    kernels = _triton_kernels()
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        WRITE_ROW=write_row,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        **TILE_CONFIG["block_128x128"],
    )
    grid = kernels.grid_size(rows, cols, BLOCK_128, BLOCK_128)
    return kernels.block_128x128_kernel, grid, constants


def block_128x128_args(x2d, data, scale_inv, data_t, scale_inv_t, record_bits) -> tuple:
    placeholder = data if data is not None else data_t
    return (
        x2d,
        placeholder,
        scale_inv,
        placeholder if data_t is None else data_t,
        scale_inv if scale_inv_t is None else scale_inv_t,
        record_bits if record_bits is not None else scale_inv,
        x2d.shape[0],
        x2d.shape[1],
    )


def launch_block_128x128(
    x2d, *, data, scale_inv, data_t, scale_inv_t, record_bits, fp8_dtype, power_2_scale
) -> None:
    """128x128 weight blocks: bytes + (ceil(M/128), ceil(K/128)) scale grid, and/or the [K, M]
    transposed bytes + transposed grid; record_bits (int32) gets max|x| when given."""
    if (data_t is None) != (scale_inv_t is None):
        raise ValueError("the transposed 128x128 bytes and scale grid come together")
    rows, cols = x2d.shape
    kernel, grid, constants = block_128x128_spec(
        rows,
        cols,
        write_row=data is not None,
        write_t=data_t is not None,
        record=record_bits is not None,
        fp8_dtype=fp8_dtype,
        power_2_scale=power_2_scale,
        input_dtype=x2d.dtype,
    )
    args = block_128x128_args(x2d, data, scale_inv, data_t, scale_inv_t, record_bits)
    launch(kernel, grid, args, constants)


def block_1x128_rows_spec(
    rows, cols, *, record, row_scale_t, fp8_dtype, power_2_scale, input_dtype
) -> tuple:
    """(kernel, grid, constexprs) of the rowwise 1x128 kernel; args (x2d, row, row_sinv,
    record_bits or row_sinv, rows, cols)."""
    config = TILE_CONFIG["block_1x128"]
    grid = (ceil_div(cols, BLOCK_128) * ceil_div(rows, config["BM"] * config["GROUP"]),)
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        ROW_SCALE_T=row_scale_t,
        RECORD_AMAX=record,
        **config,
    )
    return _triton_kernels().block_1x128_rows_kernel, grid, constants


def block_128x1_cols_spec(
    rows, cols, *, columnwise, write_t, record, fp8_dtype, power_2_scale, input_dtype
) -> tuple:
    """(kernel, grid, constexprs) of the columnwise 128x1 kernel; args (x2d, col, col_sinv,
    col_t, record_bits or col_sinv, rows, cols), an absent output pointing at the other."""
    config = TILE_CONFIG["block_128x1"]
    grid = (ceil_div(rows, BLOCK_128) * ceil_div(cols, config["BK"]),)
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        COLUMNWISE=columnwise,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        **config,
    )
    return _triton_kernels().block_128x1_cols_kernel, grid, constants


def block_1x128_fused_spec(
    rows,
    cols,
    *,
    columnwise,
    write_t,
    record,
    row_scale_t,
    fp8_dtype,
    power_2_scale,
    input_dtype,
) -> tuple | None:
    """(kernel, grid, constexprs) of the one launch writing both 1x128 copies, args (x2d,
    row, row_sinv, col, col_sinv, col_t, record_bits, rows, cols): block_1x128_pair_kernel
    for the transposed copy (Fp8Linear's operands) where TILE_CONFIG configures it, else
    block_1x128_fused_kernel; None when TILE_CONFIG picks the two single-copy kernels (or
    only the fused kernel and rows % 4 != 0). Without the transpose (the API's columnwise
    bytes in x's shape) the fused kernel measured faster on the H200: 76.8% of copy
    against the pair's 66.5% (docs/benchmarks/fp8_quantize_pair_kernel_h200_2026-12-01.md)."""
    kernels = _triton_kernels()
    pair = TILE_CONFIG["block_1x128_pair"] if write_t else {}
    config = pair or TILE_CONFIG["block_1x128_fused"]
    if not config or (not pair and rows % 4):
        return None
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        ROW_SCALE_T=row_scale_t,
        COLUMNWISE=columnwise,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        **config,
    )
    tiles = kernels.grid_size(rows, cols, BLOCK_128, BLOCK_128)[0]
    if pair:
        programs_per_tile = BLOCK_128 // pair["BM"] + BLOCK_128 // pair["BK"]
        return kernels.block_1x128_pair_kernel, (tiles * programs_per_tile,), constants
    return kernels.block_1x128_fused_kernel, (tiles,), constants


def launch_block_1x128(
    x2d,
    *,
    row,
    row_sinv,
    col,
    col_sinv,
    col_t,
    record_bits,
    row_scale_t,
    fp8_dtype,
    power_2_scale,
) -> None:
    """1x128 rowwise bytes/scales (row_scale_t: scales stored [ceil(K/128), M]) and 128x1
    columnwise bytes in x's shape (col) and/or transposed (col_t), scales [ceil(M/128), K].
    Both copies at once take one launch where TILE_CONFIG enables one (block_1x128_fused_spec:
    the paired kernel with the transpose, the fused kernel where rows % 4 == 0); otherwise
    each copy has its own kernel."""
    rows, cols = x2d.shape
    options = dict(fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, input_dtype=x2d.dtype)
    fused = None
    if row is not None and (col is not None or col_t is not None):
        fused = block_1x128_fused_spec(
            rows,
            cols,
            columnwise=col is not None,
            write_t=col_t is not None,
            record=record_bits is not None,
            row_scale_t=row_scale_t,
            **options,
        )
    if fused is not None:
        col_out = col if col is not None else col_t
        args = (
            x2d,
            row,
            row_sinv,
            col_out,
            col_sinv,
            col_t if col_t is not None else col_out,
            record_bits if record_bits is not None else row_sinv,
            rows,
            cols,
        )
        launch(*fused[:2], args, fused[2])
        return
    if row is not None:
        kernel, grid, constants = block_1x128_rows_spec(
            rows, cols, record=record_bits is not None, row_scale_t=row_scale_t, **options
        )
        args = (
            x2d,
            row,
            row_sinv,
            record_bits if record_bits is not None else row_sinv,
            rows,
            cols,
        )
        launch(kernel, grid, args, constants)
        record_bits = None  # recorded once
    if col is None and col_t is None:
        return
    kernel, grid, constants = block_128x1_cols_spec(
        rows,
        cols,
        columnwise=col is not None,
        write_t=col_t is not None,
        record=record_bits is not None,
        **options,
    )
    placeholder = col if col is not None else col_t
    args = (
        x2d,
        placeholder,
        col_sinv,
        placeholder if col_t is None else col_t,
        record_bits if record_bits is not None else col_sinv,
        rows,
        cols,
    )
    launch(kernel, grid, args, constants)


def _blockwise_triton(
    x2d, *, fp8_dtype, weight, rowwise, columnwise, power_2_scale, with_transpose
):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = _amax_buffer(device)
    out = dict.fromkeys(_KEYS)
    out["amax"] = amax_bits.view(torch.float32)
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    data_t = _empty_u8(cols, rows, device) if with_transpose else None
    if weight:
        data = _empty_u8(rows, cols, device)
        scale_inv = torch.empty((row_blocks, col_blocks), dtype=torch.float32, device=device)
        if x2d.numel() > 0:
            launch_block_128x128(
                x2d,
                data=data,
                scale_inv=scale_inv,
                data_t=data_t,
                scale_inv_t=None if data_t is None else torch.empty_like(scale_inv.t()),
                record_bits=amax_bits,
                fp8_dtype=fp8_dtype,
                power_2_scale=power_2_scale,
            )
        _fill_weight_copies(out, data, scale_inv, rowwise=rowwise, columnwise=columnwise)
    else:
        row_data = _empty_u8(rows, cols, device) if rowwise else None
        row_sinv = torch.empty((rows, col_blocks), dtype=torch.float32, device=device)
        col_data = _empty_u8(rows, cols, device) if columnwise else None
        col_sinv = torch.empty((row_blocks, cols), dtype=torch.float32, device=device)
        if x2d.numel() > 0:
            launch_block_1x128(
                x2d,
                row=row_data,
                row_sinv=row_sinv,
                col=col_data,
                col_sinv=col_sinv,
                col_t=data_t,
                record_bits=amax_bits,
                row_scale_t=False,
                fp8_dtype=fp8_dtype,
                power_2_scale=power_2_scale,
            )
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = row_data, row_sinv
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = col_data, col_sinv
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


def mxfp8_spec(
    rows, cols, *, rowwise, columnwise, write_t, record, fp8_dtype, dequant, e_words_ok: bool = True
) -> tuple:
    """(kernel, grid, constexprs) of the MX kernel (args: `mxfp8_args`). `e_words_ok`: the
    rowwise E8M0 tensor is a contiguous [rows, cols / 32] buffer at a 4-byte-aligned address,
    so the kernel may store its bytes as int16 / int32 words (E_WORDS)."""
    key = "mxfp8_dequantized" if dequant else "mxfp8"
    quads = TILE_CONFIG[key.replace("mxfp8", "mxfp8_quads")]
    use_quads = bool(quads) and not write_t
    config = quads if use_quads else TILE_CONFIG[key]
    constants = dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        RCP_FP8_MAX=fp8_max_reciprocal(fp8_dtype),
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        DEQUANT=dequant,
        **config,
    )
    grid = (ceil_div(rows, MX_BLOCK) * ceil_div(cols, MX_BLOCK * config["CHUNKS"]),)
    # Packed rowwise E8M0 words (one store per row and program, not one per chunk): whole
    # words per row, of four chunks (quads kernel) or two or four (mxfp8_kernel).
    chunks = config["CHUNKS"]
    constants["E_WORDS"] = (
        e_words_ok
        and rowwise
        and not dequant
        and chunks in ((4,) if use_quads else (2, 4))
        and cols % (chunks * MX_BLOCK) == 0
    )
    if use_quads:
        del constants["WRITE_T"]
        return _triton_kernels().mxfp8_quads_kernel, grid, constants
    return _triton_kernels().mxfp8_kernel, grid, constants


def mxfp8_args(x2d, row, row_e, col, col_e, col_t, record_bits) -> tuple:
    """The MX kernel's runtime arguments; absent outputs point at present ones (unused)."""
    placeholder = next(t for t in (row, col, col_t) if t is not None)
    e_placeholder = row_e if row_e is not None else (col_e if col_e is not None else placeholder)
    return (
        x2d,
        placeholder if row is None else row,
        e_placeholder if row_e is None else row_e,
        placeholder if col is None else col,
        e_placeholder if col_e is None else col_e,
        placeholder if col_t is None else col_t,
        record_bits if record_bits is not None else e_placeholder,
        x2d.shape[0],
        x2d.shape[1],
    )


def launch_mxfp8(x2d, *, row, row_e, col, col_e, col_t, record_bits, fp8_dtype, dequant) -> None:
    """MX 1x32 rowwise and 32x1 columnwise copies from one read. dequant: row / col are
    high-precision outputs that receive dequantize(quantize(x)) (no bytes, no scales)."""
    rows, cols = x2d.shape
    # Word stores of the E8M0 bytes need a contiguous, word-aligned row_e (callers may pass
    # views into a larger buffer, e.g. piece_quantize.quantize_mxfp8_rows_).
    e_words_ok = row_e is not None and row_e.is_contiguous() and row_e.data_ptr() % 4 == 0
    kernel, grid, constants = mxfp8_spec(
        rows,
        cols,
        rowwise=row is not None,
        columnwise=col is not None,
        write_t=col_t is not None,
        record=record_bits is not None,
        fp8_dtype=fp8_dtype,
        dequant=dequant,
        e_words_ok=e_words_ok,
    )
    launch(kernel, grid, mxfp8_args(x2d, row, row_e, col, col_e, col_t, record_bits), constants)


def _mxfp8_triton(x2d, *, fp8_dtype, rowwise, columnwise, with_transpose):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = _amax_buffer(device)
    out = dict.fromkeys(_KEYS)
    out["amax"] = amax_bits.view(torch.float32)
    row_data = _empty_u8(rows, cols, device) if rowwise else None
    row_e = _empty_u8(rows, ceil_div(cols, MX_BLOCK), device)
    col_data = _empty_u8(rows, cols, device) if columnwise else None
    col_e = _empty_u8(ceil_div(rows, MX_BLOCK), cols, device)
    data_t = _empty_u8(cols, rows, device) if with_transpose else None
    if x2d.numel() > 0:
        launch_mxfp8(
            x2d,
            row=row_data,
            row_e=row_e if rowwise else None,
            col=col_data,
            col_e=col_e if (columnwise or with_transpose) else None,
            col_t=data_t,
            record_bits=amax_bits,
            fp8_dtype=fp8_dtype,
            dequant=False,
        )
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = row_data, row_e
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = col_data, col_e
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


def mxfp8_dequantize(
    data: torch.Tensor,
    e8m0: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Fused MXFP8 dequantize of 2-D bytes: q * 2^(e - 127) per element, cast to out_dtype.

    e8m0 is (M, K/32) for rowwise bytes or (M/32, K) for columnwise ones (uint8 or e8m0fnu).
    Bitwise equal to the reference dequantize (exact fp32 product, then one rounding)."""
    rows, cols = data.shape
    e8m0 = e8m0.view(torch.uint8).contiguous()
    kernels = _triton_kernels()
    if not data.is_cuda or kernels is None:
        multiplier = tq.e8m0_dequant_multiplier(e8m0)
        if columnwise:
            multiplier = multiplier.repeat_interleave(MX_BLOCK, dim=0)[:rows]
        else:
            multiplier = multiplier.repeat_interleave(MX_BLOCK, dim=1)[:, :cols]
        return (data.view(fp8_dtype).float() * multiplier).to(out_dtype)
    out = torch.empty((rows, cols), dtype=out_dtype, device=data.device)
    config = TILE_CONFIG["mxfp8_dequant"]
    if data.numel() > 0:
        launch(
            kernels.mxfp8_dequantize_kernel,
            (ceil_div(rows, MX_BLOCK) * ceil_div(cols, MX_BLOCK * config["CHUNKS"]),),
            (data.view(torch.uint8).contiguous(), e8m0, out, rows, cols),
            dict(E4M3=fp8_dtype == torch.float8_e4m3fn, COLUMNWISE=columnwise, **config),
        )
    return out


def delayed_update(
    histories: torch.Tensor,
    scales: torch.Tensor,
    *,
    fp8_dtype: torch.dtype,
    margin: int,
    amax_compute_algo: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(new scales [N], rolled histories [N, L]) of stacked CUDA histories in one kernel, or
    None where the kernel cannot run (the caller then uses the torch reference)."""
    kernels = _triton_kernels()
    if not histories.is_cuda or kernels is None or margin < 0 or margin > 100:
        return None
    histories = histories.contiguous()
    rows, length = histories.shape
    new_scales = torch.empty(rows, dtype=torch.float32, device=histories.device)
    rolled = torch.empty_like(histories)
    constants = dict(
        FP8_MAX=fp8_max(fp8_dtype),
        MARGIN_FACTOR=2.0**-margin,
        MOST_RECENT=amax_compute_algo == "most_recent",
        BLOCK_L=max(16, 1 << (length - 1).bit_length()),
        num_warps=4,
    )
    launch(
        kernels.delayed_update_kernel,
        (rows,),
        (histories, scales.contiguous(), new_scales, rolled, length),
        constants,
    )
    return new_scales, rolled


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """Row-major transpose of 2-D FP8 bytes (the per-tensor "transpose cache")."""
    if data.dim() != 2:
        raise ValueError(f"transpose_fp8 takes a 2-D tensor, got shape {tuple(data.shape)}")
    kernels = _triton_kernels()
    if not data.is_cuda or kernels is None or data.numel() == 0:
        return data.t().contiguous()
    src = data.contiguous()
    rows, cols = src.shape
    dst = torch.empty((cols, rows), dtype=src.dtype, device=src.device)
    kernels.transpose_kernel[kernels.grid_size(rows, cols, BLOCK_128, BLOCK_128)](
        src.view(torch.uint8), dst.view(torch.uint8), rows, cols, TILE=BLOCK_128, num_warps=4
    )
    return dst
