"""What every quantize kernel family shares: launch configurations, the lazily loaded Triton
kernels, small buffers and the block recipes' torch fallback (the reference rules, unfused)."""

from __future__ import annotations

import torch

from megatron.core.fp8.debug import DEBUG
from megatron.core.fp8.recipe import RecipeSpec
from megatron.core.fp8.reference import quantize_blocks
from megatron.core.numerics import amax_ignoring_nan

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


def tile_config(key: str) -> dict:
    """Kernel `key`'s launch configuration: `DEBUG.tiles[key]` where set, else TILE_CONFIG's."""
    return DEBUG.tiles.get(key, TILE_CONFIG[key])


_triton_module: list = []  # [the kernel module or None], once resolved


def triton_kernels():
    """The Triton kernel module, or None when Triton cannot be imported here. A plain memo, no
    lru_cache: Fp8Linear's backend choice calls this inside compiled regions, where Dynamo
    ignores an lru_cache and warns."""
    if not _triton_module:
        try:
            from megatron.core.fp8.cuda import triton_quantize
        except ImportError:
            triton_quantize = None
        _triton_module.append(triton_quantize)
    return _triton_module[0]


def triton_available() -> bool:
    """Whether the fused Triton kernels can run (Triton importable and a CUDA device present)."""
    return torch.cuda.is_available() and triton_kernels() is not None


def use_triton(x: torch.Tensor, force_torch: bool = False) -> bool:
    """Whether the fused kernels run for x: a CUDA tensor, Triton importable, not force_torch."""
    return not force_torch and x.is_cuda and triton_kernels() is not None


def scalar_f32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.float32).reshape(())


def whole_amax_torch(x2d: torch.Tensor) -> torch.Tensor:
    if x2d.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x2d.device)
    return amax_ignoring_nan(x2d)


COPY_KEYS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def copies(amax, row: tuple | None, col: tuple | None, data_t=None) -> dict:
    """The dict quantize_cuda returns: each direction's (data, scale_inv), None where it was not
    asked for; the amax; columnwise_data_t where the transposed columnwise bytes were made."""
    out = dict(zip(COPY_KEYS, (*(row or (None, None)), *(col or (None, None)))))
    out["amax"] = amax
    if data_t is not None:
        out["columnwise_data_t"] = data_t
    return out


def blocks_torch(
    x2d, *, spec: RecipeSpec, role, fp8_dtype, rowwise, columnwise, power_2_scale, with_transpose
):
    """Blockwise or mxfp8 copies by the reference rules, unfused. 128x128 weight blocks: the
    columnwise copy is the rowwise one (a GEMM reads its transpose through the transpose cache).
    """
    options = dict(
        spec=spec, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, input_dtype=x2d.dtype
    )
    made: dict[tuple[int, int], tuple] = {}
    for columnwise_copy, wanted in ((False, rowwise), (True, columnwise)):
        cell = spec.block_shape(role, columnwise=columnwise_copy)
        if wanted and cell not in made:
            made[cell] = quantize_blocks(x2d.float(), cell=cell, **options)
    row = made[spec.block_shape(role, columnwise=False)] if rowwise else None
    col = made[spec.block_shape(role, columnwise=True)] if columnwise else None
    data_t = col[0].t().contiguous() if with_transpose else None
    return copies(whole_amax_torch(x2d), row, col, data_t)


def empty_u8(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.empty((rows, cols), dtype=torch.uint8, device=device)


def amax_buffer(device: torch.device) -> torch.Tensor:
    """int32 cell for the atomic max of fp32 amax bits; 0 is the bit pattern of +0.0."""
    return torch.zeros((), dtype=torch.int32, device=device)
