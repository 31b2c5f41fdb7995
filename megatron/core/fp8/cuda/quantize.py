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
    RECIPES,
    ROLES,
    as_2d_shape,
    ceil_div,
    check_fp8_dtype,
    fp8_max,
    fp8_max_reciprocal,
    infinite_scale_replacement,
)

# Tile shapes. Per-tensor casts stream 64x128 tiles (rows of 256 B for bf16 input); tiles that
# also write a transpose are square so that both stores stay coalesced. Block recipes use one
# program per 128x128 tile so that every block's amax is finished inside one program.
_CAST_TILE = (64, 128)
_CAST_T_TILE = (128, 128)
_AMAX_BLOCK = 8192
_MX_TILE = (64, 128)
_WARPS = 8


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
        recipe=recipe, fp8_dtype=fp8_dtype, role=role, rowwise=rowwise,
        columnwise=columnwise, scale=scale, amax=amax, with_transpose=with_transpose,
    )  # fmt: skip
    x = x.contiguous()
    rows, cols = as_2d_shape(x.shape)
    x2d = x.view(rows, cols)
    triton_path = _use_triton(x, force_torch)
    if recipe in ("delayed", "tensorwise"):
        run = _per_tensor_triton if triton_path else _per_tensor_torch
        out = run(x2d, recipe=recipe, fp8_dtype=fp8_dtype, scale=scale, amax=amax,
                  power_2_scale=power_2_scale, with_transpose=with_transpose)  # fmt: skip
        out["columnwise_data"] = out["rowwise_data"] if columnwise else None
        out["columnwise_scale_inv"] = out["rowwise_scale_inv"] if columnwise else None
        if not rowwise:
            out["rowwise_data"] = out["rowwise_scale_inv"] = None
    elif recipe == "blockwise":
        run = _blockwise_triton if triton_path else _blockwise_torch
        out = run(x2d, fp8_dtype=fp8_dtype, weight=role == "weight", rowwise=rowwise,
                  columnwise=columnwise, power_2_scale=power_2_scale,
                  with_transpose=with_transpose)  # fmt: skip
    else:
        run = _mxfp8_triton if triton_path else _mxfp8_torch
        out = run(x2d, fp8_dtype=fp8_dtype, rowwise=rowwise, columnwise=columnwise,
                  with_transpose=with_transpose)  # fmt: skip
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
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise=True, columnwise=True")
    if with_transpose and not columnwise:
        raise ValueError("with_transpose=True transposes the columnwise copy: set columnwise=True")
    if recipe == "delayed" and scale is None:
        raise ValueError("recipe='delayed' quantizes with the current scale: pass scale=")
    if recipe != "delayed" and scale is not None:
        raise ValueError(f"scale= is only for recipe='delayed', got recipe={recipe!r}")
    if recipe != "tensorwise" and amax is not None:
        raise ValueError(f"amax= is only for recipe='tensorwise', got recipe={recipe!r}")


def _scalar_f32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.float32).reshape(())


def _whole_amax_torch(x2d: torch.Tensor) -> torch.Tensor:
    if x2d.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x2d.device)
    return tq.nan_ignoring_abs(x2d.float()).amax()


def _per_tensor_torch(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    if recipe == "delayed":
        amax_out = _whole_amax_torch(x2d)
        scale_used = _scalar_f32(scale, x2d.device)
    else:
        amax_out = _whole_amax_torch(x2d) if amax is None else _scalar_f32(amax, x2d.device)
        scale_used = tq.scale_from_amax(
            amax_out, fp8_dtype=fp8_dtype,
            inf_scale=infinite_scale_replacement(recipe=recipe, input_dtype=x2d.dtype),
            power_2_scale=power_2_scale,
        )  # fmt: skip
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


def _per_tensor_triton(x2d, *, recipe, fp8_dtype, scale, amax, power_2_scale, with_transpose):
    kernels = _triton_kernels()
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = _amax_buffer(device)
    delayed = recipe == "delayed"
    if not delayed and amax is None and x2d.numel() > 0:
        grid = (ceil_div(x2d.numel(), _AMAX_BLOCK),)
        kernels.amax_kernel[grid](x2d, amax_bits, x2d.numel(), BLOCK=_AMAX_BLOCK, num_warps=_WARPS)
    amax_out = amax_bits.view(torch.float32)
    if amax is not None:
        amax_out = _scalar_f32(amax, device)
    scale_in = _scalar_f32(scale, device) if delayed else amax_out
    data = _empty_u8(rows, cols, device)
    data_t = _empty_u8(cols, rows, device) if with_transpose else data
    scale_inv = torch.ones((), dtype=torch.float32, device=device)
    bm, bk = _CAST_T_TILE if with_transpose else _CAST_TILE
    if x2d.numel() > 0:
        kernels.per_tensor_cast_kernel[kernels.grid_size(rows, cols, bm, bk)](
            x2d, data, data_t, scale_in, amax_out, scale_inv, amax_bits, rows, cols,
            FP8_MAX=fp8_max(fp8_dtype), E4M3=fp8_dtype == torch.float8_e4m3fn,
            INF_SCALE=infinite_scale_replacement(recipe=recipe, input_dtype=x2d.dtype),
            POW2=power_2_scale and not delayed, SCALE_GIVEN=delayed, RECORD_AMAX=delayed,
            WRITE_T=with_transpose, BM=bm, BK=bk, num_warps=_WARPS,
        )  # fmt: skip
    else:
        scale_inv = _per_tensor_torch(
            x2d, recipe=recipe, fp8_dtype=fp8_dtype, scale=scale, amax=amax,
            power_2_scale=power_2_scale, with_transpose=False,
        )["rowwise_scale_inv"]  # fmt: skip
    out = {"rowwise_data": data, "rowwise_scale_inv": scale_inv, "amax": amax_out}
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


def _blockwise_triton(
    x2d, *, fp8_dtype, weight, rowwise, columnwise, power_2_scale, with_transpose
):
    kernels = _triton_kernels()
    rows, cols = x2d.shape
    device = x2d.device
    amax_bits = _amax_buffer(device)
    out = dict.fromkeys(_KEYS)
    out["amax"] = amax_bits.view(torch.float32)
    constants = dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        INF_SCALE=infinite_scale_replacement(recipe="blockwise", input_dtype=x2d.dtype),
        POW2=power_2_scale,
        WRITE_T=with_transpose,
        TILE=BLOCK_128,
        num_warps=_WARPS,
    )
    grid = kernels.grid_size(rows, cols, BLOCK_128, BLOCK_128)
    row_blocks, col_blocks = ceil_div(rows, BLOCK_128), ceil_div(cols, BLOCK_128)
    data_t = _empty_u8(cols, rows, device) if with_transpose else None
    if weight:
        data = _empty_u8(rows, cols, device)
        scale_inv = torch.empty((row_blocks, col_blocks), dtype=torch.float32, device=device)
        if x2d.numel() > 0:
            kernels.block_128x128_kernel[grid](
                x2d, data, scale_inv, data if data_t is None else data_t, amax_bits, rows, cols,
                **constants,
            )  # fmt: skip
        _fill_weight_copies(out, data, scale_inv, rowwise=rowwise, columnwise=columnwise)
    else:
        row_data = _empty_u8(rows, cols, device) if rowwise else None
        row_sinv = torch.empty((rows, col_blocks), dtype=torch.float32, device=device)
        col_data = _empty_u8(rows, cols, device) if columnwise else None
        col_sinv = torch.empty((row_blocks, cols), dtype=torch.float32, device=device)
        placeholder = row_data if row_data is not None else col_data
        if x2d.numel() > 0:
            kernels.block_1x128_kernel[grid](
                x2d, placeholder if row_data is None else row_data, row_sinv,
                placeholder if col_data is None else col_data, col_sinv,
                placeholder if data_t is None else data_t, amax_bits, rows, cols,
                ROWWISE=rowwise, COLUMNWISE=columnwise, **constants,
            )  # fmt: skip
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = row_data, row_sinv
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = col_data, col_sinv
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


def _mxfp8_triton(x2d, *, fp8_dtype, rowwise, columnwise, with_transpose):
    kernels = _triton_kernels()
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
    placeholder = row_data if row_data is not None else col_data
    bm, bk = _MX_TILE
    if x2d.numel() > 0:
        kernels.mxfp8_kernel[kernels.grid_size(rows, cols, bm, bk)](
            x2d, placeholder if row_data is None else row_data, row_e,
            placeholder if col_data is None else col_data, col_e,
            placeholder if data_t is None else data_t, amax_bits, rows, cols,
            FP8_MAX=fp8_max(fp8_dtype), E4M3=fp8_dtype == torch.float8_e4m3fn,
            RCP_FP8_MAX=fp8_max_reciprocal(fp8_dtype), ROWWISE=rowwise,
            COLUMNWISE=columnwise, WRITE_T=with_transpose, BM=bm, BK=bk, num_warps=_WARPS,
        )  # fmt: skip
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = row_data, row_e
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = col_data, col_e
    if with_transpose:
        out["columnwise_data_t"] = data_t
    return out


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
