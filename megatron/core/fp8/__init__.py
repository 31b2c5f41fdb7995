"""FP8 numerics: formats, recipes, quantizers, QuantizedTensor, FP8 GEMM and Fp8Linear."""

from megatron.core.fp8.config import FP8_FORMATS, FP8_RECIPES, Fp8Config

__all__ = ["FP8_FORMATS", "FP8_RECIPES", "Fp8Config"]
