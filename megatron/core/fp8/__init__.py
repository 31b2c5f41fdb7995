"""FP8 numerics: formats, recipes, quantizers, QuantizedTensor, FP8 GEMM and Fp8Linear."""

from megatron.core.fp8.autocast import (
    delayed_scaling_state_dict,
    fp8_autocast,
    load_delayed_scaling_state_dict,
)
from megatron.core.fp8.config import FP8_FORMATS, FP8_RECIPES, Fp8Config
from megatron.core.fp8.formats import E4M3, E5M2, fp8_dtype_for_role, fp8_max
from megatron.core.fp8.linear import Fp8Linear
from megatron.core.fp8.param_init import (
    clear_high_precision_init_val,
    get_high_precision_init_val,
    quantized_model_init,
)
from megatron.core.fp8.quantization import compute_scale, fp8_gemm, quantize
from megatron.core.fp8.quantized_tensor import Fp8DataReleasedError, Fp8Operand, QuantizedTensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "Fp8Config",
    "Fp8DataReleasedError",
    "Fp8Linear",
    "Fp8Operand",
    "QuantizedTensor",
    "clear_high_precision_init_val",
    "compute_scale",
    "delayed_scaling_state_dict",
    "fp8_autocast",
    "fp8_gemm",
    "fp8_dtype_for_role",
    "fp8_max",
    "get_high_precision_init_val",
    "load_delayed_scaling_state_dict",
    "quantize",
    "quantized_model_init",
]
