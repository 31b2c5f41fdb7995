"""quantized_model_init: build Fp8Linear weights that exist only in FP8 (FP8_NUMERICS.md,
"FP8 parameters").

Inside the context each Fp8Linear initializes its weight as nn.Linear does, quantizes it into
a QuantizedTensor parameter and (preserve_high_precision_init_val) keeps the high-precision
value on CPU, so the FSDP engine seeds fp32 main params with the init values, not dequantized
FP8 (get_high_precision_init_val / clear_high_precision_init_val).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import FP8_RECIPES, is_recipe, recipe_spec

_HP_INIT_ATTR = "_high_precision_init_val"


@dataclass(frozen=True)
class _QuantizedInit:
    recipe: str | None
    preserve_high_precision_init_val: bool


_active: list[_QuantizedInit] = []


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: str | Fp8Config | None = None,
    preserve_high_precision_init_val: bool = True,
) -> Iterator[None]:
    """Fp8Linears built inside store their weight as FP8 (a QuantizedTensor parameter).

    TransformerEngine's signature, also exported by megatron.core.distributed.fsdp.
    enabled=False: a no-op. recipe: a recipe name or an Fp8Config (its recipe); None means each
    layer's own Fp8Config recipe; a name must match it (checked).
    """
    if not enabled:
        yield
        return
    if isinstance(recipe, Fp8Config):
        recipe = recipe.recipe
    if recipe is not None and not is_recipe(recipe):
        raise ValueError(f"recipe must be one of {FP8_RECIPES} or None, got {recipe!r}")
    _active.append(_QuantizedInit(recipe, preserve_high_precision_init_val))
    try:
        yield
    finally:
        _active.pop()


def current_quantized_init() -> _QuantizedInit | None:
    return _active[-1] if _active else None


def quantize_weight_for_init(
    weight: torch.Tensor,
    *,
    config: Fp8Config,
    init: _QuantizedInit,
    scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """An FP8 nn.Parameter (QuantizedTensor) from a freshly initialized high-precision weight."""
    if init.recipe is not None and config.spec != recipe_spec(init.recipe):
        raise ValueError(
            f"quantized_model_init(recipe='{init.recipe}') but the layer's Fp8Config uses "
            f"'{config.recipe}'; pass the same recipe to both"
        )
    qt = quantize(
        weight.detach(),
        recipe=config.recipe,
        role="weight",
        fp8_dtype=fp8_dtype_for_role(config.fp8_format, "weight"),
        rowwise=True,
        # mxfp8 dgrad needs 32x1 blocks, which cannot be derived from rowwise bytes.
        columnwise=config.spec.columnwise_copy("weight"),
        scale=scale,
        power_2_scale=config.quantize_power_2_scale,
    )
    param = nn.Parameter(qt, requires_grad=True)
    # A meta-device weight has no values to keep: the FSDP engine's init_fn seeds main params.
    if init.preserve_high_precision_init_val and not weight.is_meta:
        setattr(param, _HP_INIT_ATTR, weight.detach().to("cpu", copy=True))
    return param


def get_high_precision_init_val(param: torch.Tensor) -> torch.Tensor | None:
    """The high-precision initial value kept (on CPU) for an FP8 parameter, or None."""
    return getattr(param, _HP_INIT_ATTR, None)


def clear_high_precision_init_val(param: torch.Tensor) -> None:
    """Free the kept initial value once main params are seeded."""
    if hasattr(param, _HP_INIT_ATTR):
        delattr(param, _HP_INIT_ATTR)
