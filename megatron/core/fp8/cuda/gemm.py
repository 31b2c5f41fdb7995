"""`scaled_mm`: Y = A @ B^T on FP8 operands through torch._scaled_mm, with exact emulation.
What torch._scaled_mm accepts (layouts, strides, swizzles, GPUs): docs/FP8_NUMERICS.md,
"What `torch._scaled_mm` accepts"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fp8.cuda.launch import aligned_16, ceil_div
from megatron.core.fp8.formats import FP8_DTYPES
from megatron.core.fp8.quantized_tensor import Fp8Operand
from megatron.core.fp8.recipe import BLOCK_128, MX_BLOCK, recipe_spec

# torch._scaled_mm wants K and N in multiples of 16 (and so do we for M: 16-byte scale rows).
_MM_ALIGN = 16
# E8M0 byte for 2^0: padding blocks hold zeros, any finite scale works; 1.0 is the clearest.
_E8M0_ONE = 127

# "refused" is sticky: once torch._scaled_mm rejects blockwise scales it keeps doing so.
# "grid_rows": "padded" once it took a 128x128 grid with rows padded to 4 K-blocks (_gemm_scale),
# "contiguous: <why>" once it refused one (K is padded to 512 instead).
_UNTRIED = {"path": "untried", "refused": "", "grid_rows": "untried"}
_blockwise_status: dict[str, str] = dict(_UNTRIED)


def blockwise_gemm_path() -> str:
    """How blockwise GEMMs ran in this process: 'torch._scaled_mm', 'emulated: <why>' or
    'untried'. Benchmarks print it so that an emulated run is never mistaken for cuBLAS."""
    return _blockwise_status["path"]


def set_blockwise_path(path: str = "untried", **state: str) -> dict[str, str]:
    """Set the blockwise probe's state (the rest untried); returns the previous state, which
    `set_blockwise_path(**previous)` restores. For tests and benchmarks."""
    previous = dict(_blockwise_status)
    _blockwise_status.update({**_UNTRIED, "path": path, **state})
    return previous


def round_up(value: int, multiple: int) -> int:
    return ceil_div(value, multiple) * multiple


def _pad_fp8(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad FP8 data (byte 0 is +0.0); a no-op view when nothing is missing and the data
    starts where cuBLASLt reads it (16-byte aligned), else a copy."""
    if data.shape == (rows, cols) and aligned_16(data):
        return data if data.is_contiguous() else data.contiguous()
    padded = F.pad(data.view(torch.uint8), (0, cols - data.shape[1], 0, rows - data.shape[0]))
    return padded.view(data.dtype)


def scaled_mm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    *,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    recipe: str,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    emulate: bool = False,
    emulate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T -> [M, N] in out_dtype, both row-major FP8; scales are scale_inv in
    FP8_NUMERICS.md's logical grid (blockwise: at most one 128x128 operand). Blockwise always
    uses split accumulation. `emulate` dequantizes exactly and multiplies in `emulate_dtype`.
    """
    _check_operands(a_data, b_data)
    if emulate:
        return emulated_mm(
            a_data,
            b_data,
            a_scale_inv=a_scale_inv,
            b_scale_inv=b_scale_inv,
            recipe=recipe,
            out_dtype=out_dtype,
            compute_dtype=emulate_dtype,
        )
    spec = recipe_spec(recipe)  # an unknown name raises, naming the recipes
    if spec.per_tensor:
        return _per_tensor_mm(a_data, b_data, a_scale_inv, b_scale_inv, out_dtype, use_fast_accum)
    if not spec.e8m0_scales:  # blockwise: fp32 1x128 / 128x128 scales
        return _blockwise_mm(a_data, b_data, a_scale_inv, b_scale_inv, out_dtype)
    return _mxfp8_mm(a_data, b_data, a_scale_inv, b_scale_inv, out_dtype)


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_mm computes a @ b.T with a [M, K] and b [N, K]; got {tuple(a.shape)} "
            f"and {tuple(b.shape)}"
        )
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise TypeError(
            f"scaled_mm takes FP8 tensors (view uint8 bytes with .view(fp8_dtype)); got "
            f"{a.dtype} and {b.dtype}"
        )
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise TypeError("E5M2 x E5M2 GEMMs are not supported: quantize one operand as E4M3")


def _padded_scaled_mm(a, b, rows_pad: int, n_pad: int, k_pad: int, **options) -> torch.Tensor:
    """torch._scaled_mm of a and b zero-padded to (rows_pad or n_pad, k_pad), cropped back."""
    rows, n = a.shape[0], b.shape[0]
    out = torch._scaled_mm(_pad_fp8(a, rows_pad, k_pad), _pad_fp8(b, n_pad, k_pad).t(), **options)
    return out[:rows, :n].contiguous() if (rows_pad, n_pad) != (rows, n) else out


def _per_tensor_mm(a, b, a_scale_inv, b_scale_inv, out_dtype, use_fast_accum):
    k_pad, n_pad = round_up(a.shape[1], _MM_ALIGN), round_up(b.shape[0], _MM_ALIGN)
    scales = dict(scale_a=_scalar_scale(a_scale_inv), scale_b=_scalar_scale(b_scale_inv))
    options = dict(out_dtype=out_dtype, use_fast_accum=use_fast_accum, **scales)
    return _padded_scaled_mm(a, b, a.shape[0], n_pad, k_pad, **options)


def _scalar_scale(scale: torch.Tensor) -> torch.Tensor:
    """0-d fp32 as _scaled_mm takes it (a view of it, no copy), copied where cuBLASLt cannot read
    it: a scale not 16-byte aligned, as an expert's of a stacked weight (4e bytes into the
    stacked scales) is; the H100 refused one (CUBLAS_STATUS_NOT_SUPPORTED, 2026-12-07)."""
    scale = scale.float().reshape(())
    return scale if aligned_16(scale) else scale.clone()


def _block_kind(scale: torch.Tensor, *, rows: int, k: int, name: str) -> str:
    """'1x128' or '128x128' from the logical scale grid shape (one row: both read the same)."""
    k_blocks = ceil_div(k, BLOCK_128)
    if scale.dim() == 2 and tuple(scale.shape) == (rows, k_blocks):
        return "1x128"
    if scale.dim() == 2 and tuple(scale.shape) == (ceil_div(rows, BLOCK_128), k_blocks):
        return "128x128"
    raise ValueError(
        f"blockwise {name}_scale_inv must be ({rows}, {k_blocks}) for 1x128 blocks or "
        f"({ceil_div(rows, BLOCK_128)}, {k_blocks}) for 128x128 blocks; got {tuple(scale.shape)}"
    )


def _gemm_scale(scale: torch.Tensor, *, kind: str, rows: int, k_blocks: int, side: str,
                padded_rows: bool) -> torch.Tensor:  # fmt: skip
    """A scale grid padded to the operand's (rows, K blocks) with 1s, in the strides torch checks
    (`side` b: read transposed): 1x128 outer-dim-major; 128x128 row-major, a view of rows padded
    to 4 blocks with `padded_rows`."""
    grid_rows = rows if kind == "1x128" else ceil_div(rows, BLOCK_128)
    cols = round_up(k_blocks, 4) if padded_rows and kind == "128x128" else k_blocks
    grid = scale.float() if aligned_16(scale) else scale.float().clone()  # as _scalar_scale
    if grid.shape != (grid_rows, cols):
        grid = F.pad(grid, (0, cols - grid.shape[1], 0, grid_rows - grid.shape[0]), value=1.0)
    if kind == "1x128":
        return grid.t().contiguous().t() if side == "a" else grid.t().contiguous()
    grid = grid.contiguous()[:, :k_blocks]
    return grid if side == "a" else grid.t()


def _blockwise_mm(a, b, a_scale_inv, b_scale_inv, out_dtype):
    rows, k = a.shape
    n = b.shape[0]
    a_kind = _block_kind(a_scale_inv, rows=rows, k=k, name="a")
    b_kind = _block_kind(b_scale_inv, rows=n, k=k, name="b")
    if a_kind == b_kind == "128x128":
        raise ValueError("at most one operand of a blockwise GEMM may be 128x128-scaled")
    cause = _blockwise_unavailable(a.device) or _blockwise_status["refused"]
    if cause:
        _blockwise_status["path"] = f"emulated: {cause}"
        scales = dict(a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv)
        return emulated_mm(a, b, **scales, recipe="blockwise", out_dtype=out_dtype)
    # A 128x128 grid of a K-block count not a multiple of 4: rows padded, or K padded to 512.
    k_pad = round_up(k, BLOCK_128)
    odd_grid = "128x128" in (a_kind, b_kind) and (k_pad // BLOCK_128) % 4 != 0
    padded_rows = odd_grid and not _blockwise_status["grid_rows"].startswith("contiguous")
    k_pad = round_up(k, 4 * BLOCK_128) if odd_grid and not padded_rows else k_pad
    rows_pad, n_pad = round_up(rows, _MM_ALIGN), round_up(n, _MM_ALIGN)
    grids = dict(k_blocks=k_pad // BLOCK_128, padded_rows=padded_rows)
    scale_a = _gemm_scale(a_scale_inv, kind=a_kind, rows=rows_pad, side="a", **grids)
    scale_b = _gemm_scale(b_scale_inv, kind=b_kind, rows=n_pad, side="b", **grids)
    try:
        out = _padded_scaled_mm(a, b, rows_pad, n_pad, k_pad, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=out_dtype, use_fast_accum=False)  # fmt: skip
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, ValueError) as err:
        # Host-side argument checks raise before any kernel runs, so falling back is safe.
        if padded_rows:  # taken before for another shape or side, or never: K to 512 now
            _blockwise_status["grid_rows"] = f"contiguous: {str(err)[:200]}"
        else:
            _blockwise_status["refused"] = f"torch._scaled_mm refused ({str(err)[:200]})"
        return _blockwise_mm(a, b, a_scale_inv, b_scale_inv, out_dtype)
    _blockwise_status["path"] = "torch._scaled_mm"
    _blockwise_status["grid_rows"] = "padded" if padded_rows else _blockwise_status["grid_rows"]
    return out


def _blockwise_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "not a CUDA tensor"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"cuBLASLt 1x128/128x128 scaling is sm_90 only, this is sm_{major}{minor}"
    return None


def swizzle_mx_scales(e8m0: torch.Tensor) -> torch.Tensor:
    """(R, KB) E8M0 bytes -> cuBLAS's 128x4 tiled layout (32_4_4), flat float8_e8m0fnu.

    Inside one 128-row x 4-column tile, scale (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c;
    tiles are laid out row-block-major. Rows pad to 128 and columns to 4 with 2^0.
    """
    rows, blocks = e8m0.shape
    rows_pad, blocks_pad = round_up(rows, 128), round_up(blocks, 4)
    padded = F.pad(e8m0, (0, blocks_pad - blocks, 0, rows_pad - rows), value=_E8M0_ONE)
    tiles = padded.view(rows_pad // 128, 128, blocks_pad // 4, 4).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)
    return tiles.contiguous().view(-1).view(torch.float8_e8m0fnu)


def _mxfp8_mm(a, b, a_scale_inv, b_scale_inv, out_dtype):
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] < 10:
        raise RuntimeError(
            "MXFP8 GEMMs (1x32 E8M0 scales) need an sm_100+ GPU: torch._scaled_mm's 1x32 path "
            "crashes on sm_90 and is never called there. Use the emulated GEMM instead: "
            "scaled_mm(..., emulate=True) (exact dequantize, then matmul)."
        )
    rows, k = a.shape
    n = b.shape[0]
    k_pad = round_up(k, 4 * MX_BLOCK)
    rows_pad, n_pad = round_up(rows, _MM_ALIGN), round_up(n, _MM_ALIGN)
    scale_a, scale_b = (swizzle_mx_scales(s.view(torch.uint8)) for s in (a_scale_inv, b_scale_inv))
    options = dict(scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return _padded_scaled_mm(a, b, rows_pad, n_pad, k_pad, **options)


def dequantize_operand(
    data: torch.Tensor, scale_inv: torch.Tensor, *, recipe: str, dtype: torch.dtype
) -> torch.Tensor:
    """Exact dequantization of one 2-D GEMM operand whose blocks run along its last dim."""
    spec = recipe_spec(recipe)
    if spec.per_tensor:
        cell = (0, 0)
    elif spec.e8m0_scales:
        cell = (1, MX_BLOCK)
    else:
        kind = _block_kind(scale_inv, rows=data.shape[0], k=data.shape[1], name="operand")
        cell = (1 if kind == "1x128" else BLOCK_128, BLOCK_128)
    return Fp8Operand(data, scale_inv, recipe, *cell).dequantize().to(dtype)


def emulated_mm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    *,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    recipe: str,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize both operands exactly, then a @ b.T in compute_dtype (fp32 accumulation)."""
    a = dequantize_operand(a_data, a_scale_inv, recipe=recipe, dtype=compute_dtype)
    b = dequantize_operand(b_data, b_scale_inv, recipe=recipe, dtype=compute_dtype)
    return (a @ b.t()).to(out_dtype)
