"""Blockwise (1x128 / 128x1 activations and grads, 128x128 weights) quantization on CUDA:
kernel specs, arguments and launches (the torch fallback: `quantize_common.blocks_torch`)."""

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
from megatron.core.fp8.formats import fp8_max
from megatron.core.fp8.recipe import BLOCK_128, recipe_spec


def _block_constants(input_dtype: torch.dtype, fp8_dtype: torch.dtype, power_2_scale: bool) -> dict:
    return dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        INF_SCALE=recipe_spec("blockwise").infinite_scale_value(input_dtype),
        POW2=power_2_scale,
        TILE=BLOCK_128,
    )


def block_128x128_spec(
    rows, cols, *, write_row, write_t, record, fp8_dtype, power_2_scale, input_dtype
) -> tuple:
    """(kernel, grid, constexprs) of the 128x128 weight-block kernel."""
    kernels = qc.triton_kernels()
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        WRITE_ROW=write_row,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        **tile_config("block_128x128"),
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
    config = tile_config("block_1x128")
    grid = (ceil_div(cols, BLOCK_128) * ceil_div(rows, config["BM"] * config["GROUP"]),)
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        ROW_SCALE_T=row_scale_t,
        RECORD_AMAX=record,
        **config,
    )
    return qc.triton_kernels().block_1x128_rows_kernel, grid, constants


def block_128x1_cols_spec(
    rows, cols, *, columnwise, write_t, record, fp8_dtype, power_2_scale, input_dtype
) -> tuple:
    """(kernel, grid, constexprs) of the columnwise 128x1 kernel; args (x2d, col, col_sinv,
    col_t, record_bits or col_sinv, rows, cols), an absent output pointing at the other."""
    config = tile_config("block_128x1")
    grid = (ceil_div(rows, BLOCK_128) * ceil_div(cols, config["BK"]),)
    constants = dict(
        **_block_constants(input_dtype, fp8_dtype, power_2_scale),
        COLUMNWISE=columnwise,
        WRITE_T=write_t,
        RECORD_AMAX=record,
        **config,
    )
    return qc.triton_kernels().block_128x1_cols_kernel, grid, constants


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
    kernels = qc.triton_kernels()
    pair = tile_config("block_1x128_pair") if write_t else {}
    config = pair or tile_config("block_1x128_fused")
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
        col_t_out = col_t if col_t is not None else col_out
        record_out = record_bits if record_bits is not None else row_sinv
        args = (x2d, row, row_sinv, col_out, col_sinv, col_t_out, record_out, rows, cols)
        launch(*fused[:2], args, fused[2])
        return
    if row is not None:
        kernel, grid, constants = block_1x128_rows_spec(
            rows, cols, record=record_bits is not None, row_scale_t=row_scale_t, **options
        )
        record_out = record_bits if record_bits is not None else row_sinv
        launch(kernel, grid, (x2d, row, row_sinv, record_out, rows, cols), constants)
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


def blockwise_triton(x2d, *, fp8_dtype, weight, rowwise, columnwise, power_2_scale, with_transpose):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = amax_buffer(device)
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    data_t = empty_u8(cols, rows, device) if with_transpose else None
    if weight:
        data = empty_u8(rows, cols, device)
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
        row = col = (data, scale_inv)  # one copy (a GEMM's transpose: the transpose cache)
    else:
        row_data = empty_u8(rows, cols, device) if rowwise else None
        row_sinv = torch.empty((rows, col_blocks), dtype=torch.float32, device=device)
        col_data = empty_u8(rows, cols, device) if columnwise else None
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
        row, col = (row_data, row_sinv), (col_data, col_sinv)
    amax = amax_bits.view(torch.float32)
    return copies(amax, row if rowwise else None, col if columnwise else None, data_t)
