"""What the Megatron-FSDP engine (`megatron.core.distributed`) sees of FP8: the one module it
imports from `megatron.core.fp8` (the role `mixed_precision.py` plays in Megatron-FSDP).

The engine stores FP8 weights as bytes and scales in flat buffers, writes them from fp32 main
shards and gathers them; it never quantizes a whole tensor. It needs the types (`Fp8Linear`,
`QuantizedTensor`, `Fp8Config`, `RecipeSpec`, `ScalingMeta`), building
(`quantized_model_init`, the kept high-precision init value, `new_fp8_weight`), geometry (a
weight's [rows, cols] view and scale-cell grid; `MXFP8_BLOCK`, the band height of the only
recipe whose blocks can align with shard edges), piece writing (docs/FP8_NUMERICS.md: cell
amaxes, cell scales exactly as `quantize` derives them, the cast, whole mxfp8 bands) and
delayed scaling of weights. Every name delegates to the FP8 package's own rules; none changes
a number. Nothing in `megatron.core.fp8` imports `megatron.core.distributed`.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.fp8.autocast import ScalingMeta, reduce_and_update
from megatron.core.fp8.autocast import record_amaxes as record_weight_amaxes
from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.cuda.piece_quantize import cell_geometry as weight_cell_geometry
from megatron.core.fp8.cuda.piece_quantize import piece_cast_ as cast_piece_
from megatron.core.fp8.cuda.piece_quantize import piece_cell_amax_ as add_piece_cell_amaxes_
from megatron.core.fp8.cuda.piece_quantize import quantize_mxfp8_rows_ as quantize_mxfp8_bands_
from megatron.core.fp8.cuda.piece_quantize import rows_cols, stacked_cell_rows
from megatron.core.fp8.cuda.piece_quantize import rows_cols as weight_rows_cols
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.linear import Fp8Linear
from megatron.core.fp8.param_init import (
    clear_high_precision_init_val as forget_high_precision_init_value,
)
from megatron.core.fp8.param_init import get_high_precision_init_val as high_precision_init_value
from megatron.core.fp8.param_init import quantized_model_init
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.fp8.reference import block_scales, reciprocal, scale_grid_shape

__all__ = [
    "MXFP8_BLOCK",
    "Fp8Config",
    "Fp8Linear",
    "QuantizedTensor",
    "RecipeSpec",
    "ScalingMeta",
    "add_piece_cell_amaxes_",
    "advance_delayed_scales",
    "cast_piece_",
    "forget_high_precision_init_value",
    "high_precision_init_value",
    "is_fp8_linear",
    "new_fp8_weight",
    "quantize_mxfp8_bands_",
    "quantized_model_init",
    "recipe_spec",
    "record_weight_amaxes",
    "stacked_cell_rows",
    "weight_cell_geometry",
    "weight_cell_scales",
    "weight_fp8_dtype",
    "weight_rows_cols",
    "weight_scale_grid",
]

MXFP8_BLOCK = recipe_spec("mxfp8").block
"""Block length of mxfp8 (1x32 and 32x1 cells): the height of a band that owns all its blocks,
and the ratio of elements to E8M0 scale bytes in each direction."""


# ----- types and building ---------------------------------------------------------------------


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, Fp8Linear)


def weight_fp8_dtype(config: Fp8Config) -> torch.dtype:
    """The FP8 dtype a layer with these settings stores its weight in."""
    return fp8_dtype_for_role(config.fp8_format, "weight")


def new_fp8_weight(
    *,
    shape: torch.Size,
    dtype: torch.dtype,
    spec: RecipeSpec,
    fp8_dtype: torch.dtype,
    name: str,
    device: torch.device,
) -> QuantizedTensor:
    """An FP8 weight (logical dtype `dtype`) with no bytes or scales yet."""
    return QuantizedTensor(
        shape=shape,
        dtype=dtype,
        recipe=spec.name,
        fp8_dtype=fp8_dtype,
        role="weight",
        tensor_name=name,
        device=device,
    )


# ----- geometry -------------------------------------------------------------------------------


def weight_scale_grid(shape: torch.Size, spec: RecipeSpec, *, columnwise: bool) -> tuple[int, ...]:
    """Shape of a weight's scale_inv in one direction: () per tensor, else its cell grid."""
    rows, cols = rows_cols(shape)
    return scale_grid_shape(rows, cols, recipe=spec.name, role="weight", columnwise=columnwise)


# ----- writing pieces -------------------------------------------------------------------------


def weight_cell_scales(
    cell_amaxes: torch.Tensor,
    *,
    spec: RecipeSpec,
    fp8_dtype: torch.dtype,
    power_2_scale: bool | None,
    delayed_metas: list[ScalingMeta | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize multiplier, stored scale_inv) of each cell, as `quantize` derives them from
    the global amaxes; delayed: from each weight's scaling state instead (one cell each)."""
    if spec.delayed:
        scale = torch.stack([meta.scale.to(torch.float32).reshape(()) for meta in delayed_metas])
        return scale, reciprocal(scale)
    return block_scales(
        cell_amaxes,
        spec=spec,
        fp8_dtype=fp8_dtype,
        power_2_scale=spec.resolve_power_2_scale(power_2_scale),
        input_dtype=torch.float32,
    )


# ----- delayed scaling ------------------------------------------------------------------------


def advance_delayed_scales(metas: list[ScalingMeta]) -> None:
    """Apply each weight's recorded amax (scale update and history roll), all metas stacked in
    one update; no collective (the amaxes recorded were already global)."""
    reduce_and_update(metas, None)
