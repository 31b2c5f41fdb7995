"""MXFP8 (1x32 / 32x1 blocks, E8M0 scales) quantization and dequantization on CUDA: kernel
specs, arguments and launches (the torch fallback: `quantize_common.blocks_torch`)."""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda.launch import ceil_div, launch
from megatron.core.fp8.cuda.quantize_common import (
    amax_buffer,
    copies,
    empty_u8,
    tile_config,
)
from megatron.core.fp8.formats import fp8_max, fp8_max_reciprocal
from megatron.core.fp8.recipe import MX_BLOCK, recipe_spec
from megatron.core.fp8.reference import dequantize_cells, quantize_blocks


def mxfp8_copy_torch(
    x2d: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP8 copy (bytes in x2d's shape, E8M0 grid) by the reference rules, unfused."""
    return quantize_blocks(
        x2d.float(),
        cell=(MX_BLOCK, 1) if columnwise else (1, MX_BLOCK),
        spec=recipe_spec("mxfp8"),
        fp8_dtype=fp8_dtype,
        power_2_scale=True,
        input_dtype=x2d.dtype,
    )


def mxfp8_spec(
    rows, cols, *, rowwise, columnwise, write_t, record, fp8_dtype, dequant, e_words_ok: bool = True
) -> tuple:
    """(kernel, grid, constexprs) of the MX kernel (args: `mxfp8_args`). `e_words_ok`: the
    rowwise E8M0 tensor is a contiguous [rows, cols / 32] buffer at a 4-byte-aligned address,
    so the kernel may store its bytes as int16 / int32 words (E_WORDS)."""
    key = "mxfp8_dequantized" if dequant else "mxfp8"
    quads = tile_config(key.replace("mxfp8", "mxfp8_quads"))
    use_quads = bool(quads) and not write_t
    config = quads if use_quads else tile_config(key)
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
        return qc.triton_kernels().mxfp8_quads_kernel, grid, constants
    return qc.triton_kernels().mxfp8_kernel, grid, constants


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


def mxfp8_triton(x2d, *, fp8_dtype, rowwise, columnwise, with_transpose):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = amax_buffer(device)
    row_data = empty_u8(rows, cols, device) if rowwise else None
    row_e = empty_u8(rows, ceil_div(cols, MX_BLOCK), device)
    col_data = empty_u8(rows, cols, device) if columnwise else None
    col_e = empty_u8(ceil_div(rows, MX_BLOCK), cols, device)
    data_t = empty_u8(cols, rows, device) if with_transpose else None
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
    row = (row_data, row_e) if rowwise else None
    col = (col_data, col_e) if columnwise else None
    return copies(amax_bits.view(torch.float32), row, col, data_t)


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
    kernels = qc.triton_kernels()
    if not data.is_cuda or kernels is None:
        cell = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
        q = data.view(fp8_dtype).float()
        return dequantize_cells(q, e8m0, cell, e8m0=True).to(out_dtype)
    out = torch.empty((rows, cols), dtype=out_dtype, device=data.device)
    config = tile_config("mxfp8_dequant")
    if data.numel() > 0:
        launch(
            kernels.mxfp8_dequantize_kernel,
            (ceil_div(rows, MX_BLOCK) * ceil_div(cols, MX_BLOCK * config["CHUNKS"]),),
            (data.view(torch.uint8).contiguous(), e8m0, out, rows, cols),
            dict(E4M3=fp8_dtype == torch.float8_e4m3fn, COLUMNWISE=columnwise, **config),
        )
    return out
