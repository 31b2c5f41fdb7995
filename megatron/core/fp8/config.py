"""FP8 settings, one dataclass built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.core.fp8.recipe import FP8_RECIPES, RecipeSpec, recipe_spec

__all__ = ["FP8_FORMATS", "FP8_RECIPES", "Fp8Config"]

FP8_FORMATS = ("e4m3", "hybrid")


@dataclass(kw_only=True)
class Fp8Config:
    """How transformer Linears quantize to FP8. Rules: docs/FP8_NUMERICS.md."""

    recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "tensorwise"
    """Scaling recipe (`--fp8-recipe`)."""

    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"
    """`hybrid`: E4M3 forward tensors, E5M2 gradients; `e4m3`: E4M3 everywhere (`--fp8-format`)."""

    margin: int = 0
    """Delayed scaling: scale = (fp8_max / amax) / 2^margin (`--fp8-margin`)."""

    amax_history_len: int = 1024
    """Delayed scaling: length of each tensor's amax history (`--fp8-amax-history-len`)."""

    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: amax from the whole history or from the newest slot."""

    power_2_scale: bool | None = None
    """Round scales down to powers of two (clear the mantissa). None means the recipe's default:
    on for blockwise, off for tensorwise; mxfp8 scales are powers of two by construction and
    delayed scaling never rounds (`--fp8-power-2-scale` / `--no-fp8-power-2-scale`)."""

    wgrad_input_from_activation: bool = True
    """fc2's wgrad GEMM quantizes its input in backward from the activation's input (fc1's
    output, which SwiGLU/GeLU keep for their own backward) instead of keeping an FP8 copy of
    the activation's output from forward: one byte per element of fc2's input less at the
    memory peak, for one more elementwise pass and quantization in backward. The same bytes
    either way; on by default (`--no-fp8-wgrad-input-from-activation` turns it off)."""

    fp8_param_gather: bool = False
    """Weights exist only as FP8 (plus fp32 main params); FSDP gathers FP8 bytes."""

    num_layers_at_start_in_bf16: int = 0
    """With `--first-last-layers-bf16`, this many leading transformer layers stay high precision."""

    num_layers_at_end_in_bf16: int = 0
    """With `--first-last-layers-bf16`, this many trailing layers stay high precision."""

    def layer_uses_fp8(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer `layer_number` (1-based) runs its Linears in FP8."""
        if layer_number <= self.num_layers_at_start_in_bf16:
            return False
        return layer_number <= num_layers - self.num_layers_at_end_in_bf16

    @property
    def spec(self) -> RecipeSpec:
        """The recipe resolved once (megatron/core/fp8/recipe.py); code below reads this."""
        return recipe_spec(self.recipe)

    @property
    def use_power_2_scale(self) -> bool:
        if self.power_2_scale is not None:
            return self.power_2_scale
        return self.spec.power_2_default

    @property
    def quantize_power_2_scale(self) -> bool | None:
        """What Fp8Linear passes to `quantize(power_2_scale=)`: None (the recipe's fixed rule)
        where the setting does not apply (delayed, mxfp8), else `use_power_2_scale`."""
        return self.use_power_2_scale if self.spec.power_2_configurable else None
