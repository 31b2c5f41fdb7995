"""Each FP8 recipe resolved once into a frozen `RecipeSpec` (docs/FP8_NUMERICS.md).

The spec carries every fact the quantizers, GEMMs, Fp8Linear and the FSDP engine branch on.
Code below the config layer reads its attributes, never compares recipe names (a `recipe: str`
is resolved once with `recipe_spec`); `RECIPE_SPECS` is the one place a name decides anything
(`tests/unit_tests/fp8/test_recipe_spec.py` checks both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.fp8.formats import FLT_MAX

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """What one recipe means for quantization, storage and GEMMs (FP8_NUMERICS.md)."""

    name: str
    """The `--fp8-recipe` name, for messages."""

    per_tensor: bool
    """One fp32 scale for the whole tensor (delayed, tensorwise); otherwise block scales."""

    delayed: bool
    """The scale comes from the caller's amax-history state (`quantize(scale=)`), and each
    quantization records an amax for the next update (delayed scaling)."""

    accepts_global_amax: bool
    """`quantize` takes a pre-reduced `amax=` or an `amax_reduction_group=` (tensorwise)."""

    block: int
    """Block length B: 1xB cells rowwise, Bx1 columnwise, BxB for 2-D (0 per tensor)."""

    square_weight_blocks: bool
    """Weights use BxB cells in both directions (blockwise: 128x128)."""

    e8m0_scales: bool
    """scale_inv holds E8M0 bytes (uint8, mxfp8); otherwise fp32 scale_inv."""

    infinite_scale_from_input_dtype: bool
    """An infinite current scale becomes the largest finite value of the input dtype
    (blockwise); otherwise FLT_MAX."""

    power_2_default: bool
    """Whether scales are rounded down to powers of two when `power_2_scale` is None."""

    power_2_configurable: bool
    """Whether `--fp8-power-2-scale` applies; delayed never rounds and E8M0 scales are powers
    of two by construction, so Fp8Linear passes None (the default) for those."""

    fast_accumulation: bool
    """fprop may use fast accumulation (per-tensor recipes); every other GEMM splits."""

    gemm_min_capability: tuple[int, int]
    """Lowest CUDA compute capability with a hardware (torch._scaled_mm) GEMM."""

    gemm_max_major: int | None
    """Highest CUDA major version with that GEMM (blockwise: sm_90 only); None: no limit."""

    fused_linear_emulates: bool
    """Fp8Linear's fused CUDA path writes dequantized values and multiplies them in high
    precision on every GPU (mxfp8: the 1x32 GEMM crashes on sm_90)."""

    def uses_2d_blocks(self, role: str) -> bool:
        """Whether `role` quantizes in BxB cells (blockwise weights)."""
        return self.square_weight_blocks and role == "weight"

    def block_shape(self, role: str, *, columnwise: bool) -> tuple[int, int] | None:
        """(rows, cols) of one scale cell of the [M, K] view; None for per-tensor recipes."""
        if self.per_tensor:
            return None
        if self.uses_2d_blocks(role):
            return (self.block, self.block)
        return (self.block, 1) if columnwise else (1, self.block)

    def transposes_rowwise(self, role: str) -> bool:
        """Whether backward's transposed operand is an exact transpose of the rowwise bytes
        (per-tensor scales, BxB cells); otherwise it is a separately quantized columnwise copy."""
        return self.per_tensor or self.uses_2d_blocks(role)

    def columnwise_copy(self, role: str) -> bool:
        """Whether GEMMs contracting over dim 0 need a columnwise copy quantized from high
        precision (1-D blocks: Bx1 cells cannot be derived from 1xB bytes)."""
        return not self.transposes_rowwise(role)

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of the stored scale_inv tensors."""
        return torch.uint8 if self.e8m0_scales else torch.float32

    def infinite_scale_value(self, input_dtype: torch.dtype) -> float:
        """What an infinite current scale (fp8_max / tiny amax) is replaced with."""
        if self.infinite_scale_from_input_dtype:
            return float(torch.finfo(input_dtype).max)
        return FLT_MAX

    def resolve_power_2_scale(self, power_2_scale: bool | None) -> bool:
        """The rounding that applies: None means the recipe default."""
        return self.power_2_default if power_2_scale is None else power_2_scale

    def hardware_gemm(self, capability: tuple[int, int]) -> bool:
        """Whether a GPU of this compute capability has this recipe's hardware GEMM."""
        if capability < self.gemm_min_capability:
            return False
        return self.gemm_max_major is None or capability[0] <= self.gemm_max_major


BLOCK_128 = 128
"""Blockwise (DeepSeek-V3) block edge: 1x128 / 128x1 activation blocks, 128x128 weight blocks."""
MX_BLOCK = 32
"""MXFP8 block length: 1x32 / 32x1 blocks with one E8M0 scale each."""

_PER_TENSOR = dict(
    per_tensor=True,
    block=0,
    square_weight_blocks=False,
    e8m0_scales=False,
    infinite_scale_from_input_dtype=False,
    power_2_default=False,
    fast_accumulation=True,
    # FP8 tensor cores and torch._scaled_mm's per-tensor path start at sm_89 (Ada).
    gemm_min_capability=(8, 9),
    gemm_max_major=None,
    fused_linear_emulates=False,
)

RECIPE_SPECS: dict[str, RecipeSpec] = {
    "delayed": RecipeSpec(
        name="delayed",
        delayed=True,
        accepts_global_amax=False,
        power_2_configurable=False,
        **_PER_TENSOR,
    ),
    "tensorwise": RecipeSpec(
        name="tensorwise",
        delayed=False,
        accepts_global_amax=True,
        power_2_configurable=True,
        **_PER_TENSOR,
    ),
    "blockwise": RecipeSpec(
        name="blockwise",
        per_tensor=False,
        delayed=False,
        accepts_global_amax=False,
        block=BLOCK_128,
        square_weight_blocks=True,
        e8m0_scales=False,
        infinite_scale_from_input_dtype=True,
        power_2_default=True,
        power_2_configurable=True,
        fast_accumulation=False,
        # cuBLASLt's 1x128 / 128x128 block scaling exists on sm_90 only.
        gemm_min_capability=(9, 0),
        gemm_max_major=9,
        fused_linear_emulates=False,
    ),
    "mxfp8": RecipeSpec(
        name="mxfp8",
        per_tensor=False,
        delayed=False,
        accepts_global_amax=False,
        block=MX_BLOCK,
        square_weight_blocks=False,
        e8m0_scales=True,
        infinite_scale_from_input_dtype=False,
        power_2_default=True,
        power_2_configurable=False,
        fast_accumulation=False,
        # The 1x32 scaled GEMM needs sm_100 (it crashes on sm_90, so it is never called there).
        gemm_min_capability=(10, 0),
        gemm_max_major=None,
        fused_linear_emulates=True,
    ),
}
"""The one table from recipe names to specs, in `FP8_RECIPES` order."""


def recipe_spec(recipe: str) -> RecipeSpec:
    """The frozen spec of `recipe`; an unknown name raises ValueError naming the choices."""
    spec = RECIPE_SPECS.get(recipe) if isinstance(recipe, str) else None
    if spec is None:
        raise ValueError(f"recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    return spec


def is_recipe(name: object) -> bool:
    """Whether `name` is one of `FP8_RECIPES`."""
    return isinstance(name, str) and name in RECIPE_SPECS


def names_delayed_scaling(recipe: str | None) -> bool:
    """Whether an `--fp8-recipe` flag value (None: no FP8), such as one saved in a checkpoint's
    metadata, means delayed scaling."""
    return recipe is not None and recipe_spec(recipe).delayed
