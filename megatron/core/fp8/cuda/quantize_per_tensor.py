"""Per-tensor (delayed, tensorwise) quantization on CUDA: amax pass, scale + cast + transpose
kernel (spec, arguments, launch), the torch fallback, and the delayed-scaling update kernel."""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda.launch import ceil_div, launch
from megatron.core.fp8.cuda.quantize_common import (
    amax_buffer,
    empty_u8,
    scalar_f32,
    tile_config,
    whole_amax_torch,
)
from megatron.core.fp8.formats import fp8_max
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import quantize_per_tensor, scale_from_amax


def per_tensor_torch(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    if recipe_spec(recipe).delayed:
        amax_out = whole_amax_torch(x2d)
        scale_used = scalar_f32(scale, x2d.device)
    else:
        amax_out = whole_amax_torch(x2d) if amax is None else scalar_f32(amax, x2d.device)
        scale_used = scale_from_amax(
            amax_out,
            fp8_dtype=fp8_dtype,
            power_2_scale=power_2_scale,
            infinite_scale_value=recipe_spec(recipe).infinite_scale_value(x2d.dtype),
        )
    data, scale_inv = quantize_per_tensor(x2d.float(), fp8_dtype=fp8_dtype, scale=scale_used)
    out = {"rowwise_data": data, "rowwise_scale_inv": scale_inv, "amax": amax_out}
    if with_transpose:
        out["columnwise_data_t"] = data.t().contiguous()
    return out


# At most this many partial maxima (a power of two: the cast kernel loads them as one block).
AMAX_PARTIALS = 256


def amax_partials_spec(numel: int) -> tuple:
    """(kernel, grid, constexprs, blocks per program) of the atomic-free amax pass into
    grid[0] partial maxima, grid[0] a power of two <= AMAX_PARTIALS."""
    block = tile_config("amax")["BLOCK"]
    blocks = ceil_div(numel, block)
    programs = min(AMAX_PARTIALS, 1 << max(blocks - 1, 0).bit_length())
    per_program = ceil_div(blocks, programs)
    constexprs = dict(
        BLOCK=block,
        EVEN=numel == programs * per_program * block,
        num_warps=tile_config("amax")["num_warps"],
    )
    return qc.triton_kernels().amax_partials_kernel, (programs,), constexprs, per_program


def launch_amax(x2d: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """Atomically max the NaN-ignoring max|x| of a contiguous tensor into int32 amax_bits."""
    config = tile_config("amax")
    grid = (ceil_div(x2d.numel(), config["BLOCK"] * config["GROUP"]),)
    launch(qc.triton_kernels().amax_kernel, grid, (x2d, amax_bits, x2d.numel()), config)


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
    config = tile_config("cast_t" if write_t else "cast")
    grid = (ceil_div(cols, config["BK"]) * ceil_div(rows, config["BM"] * config["GROUP"]),)
    constants = dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        INF_SCALE=recipe_spec(recipe).infinite_scale_value(input_dtype),
        POW2=power_2_scale and not delayed,
        SCALE_GIVEN=delayed,
        RECORD_AMAX=record,
        WRITE_ROW=write_row,
        WRITE_T=write_t,
        **config,
        AMAX_PARTIALS=amax_partials,
    )
    return qc.triton_kernels().per_tensor_cast_kernel, grid, constants


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


def per_tensor_triton(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = amax_buffer(device)
    delayed = recipe_spec(recipe).delayed
    if not delayed and amax is None and x2d.numel() > 0:
        launch_amax(x2d, amax_bits)
    amax_out = amax_bits.view(torch.float32)
    if amax is not None:
        amax_out = scalar_f32(amax, device)
    data = empty_u8(rows, cols, device)
    data_t = empty_u8(cols, rows, device) if with_transpose else None
    # Written by the cast kernel's first program (no fill kernel); empty inputs set it below.
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    if x2d.numel() > 0:
        launch_per_tensor_cast(
            x2d,
            data=data,
            data_t=data_t,
            scale=scalar_f32(scale, device) if delayed else None,
            amax=None if delayed else amax_out,
            scale_inv=scale_inv,
            record_bits=amax_bits if delayed else None,
            fp8_dtype=fp8_dtype,
            recipe=recipe,
            power_2_scale=power_2_scale,
        )
    else:
        scale_inv = per_tensor_torch(
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
    kernels = qc.triton_kernels()
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
