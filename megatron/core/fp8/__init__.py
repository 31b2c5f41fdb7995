"""FP8 numerics: formats, recipes, quantizers, QuantizedTensor, FP8 GEMM and Fp8Linear."""

from megatron.core.fp8.config import FP8_FORMATS, FP8_RECIPES, Fp8Config
from megatron.core.fp8.formats import E4M3, E5M2, fp8_dtype_for_role, fp8_max
from megatron.core.fp8.quantization import compute_scale, quantize
from megatron.core.fp8.quantized_tensor import Fp8DataReleasedError, Fp8Operand, QuantizedTensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "Fp8Config",
    "Fp8DataReleasedError",
    "Fp8Operand",
    "QuantizedTensor",
    "compute_scale",
    "fp8_dtype_for_role",
    "fp8_max",
    "quantize",
]
