"""`quantize_cuda` (`quantize(..., backend="cuda")`): fused FP8 quantization on CUDA. Triton is
imported lazily; without it, and for CPU tensors, each family (`quantize_per_tensor.py`,
`quantize_blockwise.py`, `quantize_mxfp8.py`) runs its unfused torch fallback of the reference
rules (block recipes: `quantize_common.blocks_torch`)."""

from __future__ import annotations

import torch

from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda.launch import as_2d_shape
from megatron.core.fp8.cuda.quantize_blockwise import blockwise_triton
from megatron.core.fp8.cuda.quantize_common import blocks_torch, use_triton
from megatron.core.fp8.cuda.quantize_mxfp8 import mxfp8_triton
from megatron.core.fp8.cuda.quantize_per_tensor import per_tensor_torch, per_tensor_triton
from megatron.core.fp8.recipe import BLOCK_128, recipe_spec
from megatron.core.fp8.reference import check_quantize_args


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
    """Quantize `x` under `recipe`: the reference's dict (`fp8/reference.py`, amax NaN-ignoring)
    plus, with `with_transpose`, columnwise_data_t (row-major transpose of the columnwise bytes:
    the transpose cache or a block recipe's wgrad operand). `scale`: delayed only. `amax`:
    tensorwise only, already reduced (pass one skipped). Per-tensor columnwise bytes are the
    rowwise tensor itself. `force_torch`: the torch fallback even with Triton (tests, debugging).
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
    triton_path = use_triton(x, force_torch)
    spec = recipe_spec(recipe)
    if spec.per_tensor:
        run = per_tensor_triton if triton_path else per_tensor_torch
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
    else:
        copies = dict(rowwise=rowwise, columnwise=columnwise, with_transpose=with_transpose)
        blocks = dict(fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, **copies)
        if not triton_path:
            out = blocks_torch(x2d, spec=spec, role=role, **blocks)
        elif not spec.e8m0_scales:
            out = blockwise_triton(x2d, weight=role == "weight", **blocks)
        else:
            out = mxfp8_triton(x2d, fp8_dtype=fp8_dtype, **copies)
    for key in ("rowwise_data", "columnwise_data"):
        if out[key] is not None:
            out[key] = out[key].view(x.shape)
    return out


def _check_args(*, recipe: str, with_transpose: bool, columnwise: bool, **kwargs) -> None:
    check_quantize_args(recipe_spec(recipe), columnwise=columnwise, **kwargs)
    if with_transpose and not columnwise:
        raise ValueError("with_transpose=True transposes the columnwise copy: set columnwise=True")


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """Row-major transpose of 2-D FP8 bytes (the per-tensor "transpose cache")."""
    if data.dim() != 2:
        raise ValueError(f"transpose_fp8 takes a 2-D tensor, got shape {tuple(data.shape)}")
    kernels = qc.triton_kernels()
    if not data.is_cuda or kernels is None or data.numel() == 0:
        return data.t().contiguous()
    src = data.contiguous()
    rows, cols = src.shape
    dst = torch.empty((cols, rows), dtype=src.dtype, device=src.device)
    kernels.transpose_kernel[kernels.grid_size(rows, cols, BLOCK_128, BLOCK_128)](
        src.view(torch.uint8), dst.view(torch.uint8), rows, cols, TILE=BLOCK_128, num_warps=4
    )
    return dst
