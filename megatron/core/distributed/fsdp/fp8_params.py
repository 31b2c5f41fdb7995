"""Which parameters Megatron-FSDP keeps in FP8, and how each is quantized (`Fp8ParamSpec`):
QuantizedTensor parameters, and with fp8_param_gather the weights of every Fp8Linear and of
every routed experts' Fp8StackedLinear (one matrix per expert, `fp8_matrices`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron.core.fp8.engine_interface import (
    QuantizedTensor,
    RecipeSpec,
    ScalingMeta,
    is_fp8_linear,
    recipe_spec,
    weight_fp8_dtype,
)


@dataclass(frozen=True)
class Fp8ParamSpec:
    """How one weight is quantized; weights with equal `group_key` share one buffer group."""

    recipe: str
    fp8_dtype: torch.dtype
    power_2_scale: bool | None
    """As Fp8Linear passes it to quantize (None: the recipe default)."""
    dtype: torch.dtype
    """Logical (high-precision) dtype: what the weight's grads arrive in."""
    delayed_meta: ScalingMeta | tuple[ScalingMeta, ...] | None
    """Stacked expert weights: one per expert."""

    @property
    def group_key(self) -> tuple:
        return ("fp8", self.recipe, self.fp8_dtype, self.power_2_scale, self.dtype)

    @property
    def recipe_spec(self) -> RecipeSpec:
        return recipe_spec(self.recipe)

    @property
    def directions(self) -> tuple[str, ...]:
        # A separately quantized columnwise copy (mxfp8's 32x1 blocks) needs its own buffer.
        two = self.recipe_spec.columnwise_copy("weight")
        return ("rowwise", "columnwise") if two else ("rowwise",)


def _is_fp8_stacked(module: nn.Module) -> bool:
    """The routed experts' stacked FP8 weight (Fp8StackedLinear: one Linear per expert)."""
    return getattr(module, "fp8_expert_weights", False)


def fp8_param_spec(
    root: nn.Module, name: str, param: torch.Tensor, *, convert_fp8_linears: bool
) -> Fp8ParamSpec | None:
    """The spec of an FP8 weight: a QuantizedTensor parameter (quantized_model_init), or an
    Fp8Linear's (or Fp8StackedLinear's) high-precision weight when `convert_fp8_linears`
    (fp8_param_gather)."""
    owner_path, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    is_fp8 = isinstance(param, QuantizedTensor)
    fp8_owner = is_fp8_linear(owner) or _is_fp8_stacked(owner)
    converts = convert_fp8_linears and fp8_owner and attr == "weight"
    if not is_fp8 and not converts:
        return None
    if not fp8_owner or attr != "weight":
        raise ValueError(
            f"Megatron-FSDP: FP8 parameter {name!r} is not the weight of an Fp8Linear; only "
            "Fp8Linear weights can be kept in FP8 (build other layers in high precision)"
        )
    config = owner.fp8_config
    if is_fp8 and param.spec != config.spec:
        raise ValueError(
            f"FP8 weight {name!r} was quantized with recipe {param.recipe!r} but its Fp8Linear "
            f"uses {config.recipe!r}; build the model under quantized_model_init(recipe) with "
            "the layer's recipe"
        )
    delayed_meta = None
    if config.spec.delayed and _is_fp8_stacked(owner):
        delayed_meta = tuple(s.metas["weight"] for s in owner.delayed_scaling.experts)
    elif config.spec.delayed:
        delayed_meta = owner.delayed_scaling.metas["weight"]
    return Fp8ParamSpec(
        recipe=config.recipe,
        fp8_dtype=weight_fp8_dtype(config),
        power_2_scale=config.quantize_power_2_scale,
        dtype=param.dtype,
        delayed_meta=delayed_meta,
    )


def materialize_delayed_scaling(module: nn.Module, device: torch.device) -> None:
    """Every FP8 layer's delayed-scaling state on `device`, the engine's: built on the meta
    device, the initial state (scale 1, zero history); elsewhere, its values moved. A module's
    .to() leaves this state where it was built, and a layer's forward moves only the state it
    uses (an expert's only when the expert gets tokens). The engine's weight writes read a
    unit's weight scales together (H100, delayed M-small built on the CPU: the stacked scales
    mixed CPU and CUDA tensors)."""
    for submodule in module.modules():
        scaling = getattr(submodule, "delayed_scaling", None)
        if scaling is None:
            continue
        for meta in scaling.metas.values():
            if meta.scale.is_meta:
                meta.scale = torch.ones((), dtype=torch.float32, device=device)
                meta.amax_history = torch.zeros(
                    meta.amax_history.shape, dtype=torch.float32, device=device
                )
        scaling.move_to(device)
