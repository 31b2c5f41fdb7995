"""Fast FP8 paths on CUDA: fused Triton quantization, the transpose cache, torch._scaled_mm.

Importing this package never imports Triton; the kernels load on first use on a CUDA tensor.
"""

from megatron.core.fp8.cuda.gemm import blockwise_gemm_path, scaled_mm
from megatron.core.fp8.cuda.quantize import quantize_cuda, transpose_fp8
from megatron.core.fp8.cuda.quantize_common import triton_available

__all__ = [
    "blockwise_gemm_path",
    "quantize_cuda",
    "scaled_mm",
    "transpose_fp8",
    "triton_available",
]
