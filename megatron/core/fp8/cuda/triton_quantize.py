"""The Triton kernels of every family in one namespace, loaded by `quantize_common.triton_kernels`
only when Triton is present (the family modules import `triton` at module level)."""

from megatron.core.fp8.cuda.triton_blockwise import (  # noqa: F401
    block_1x128_fused_kernel,
    block_1x128_pair_kernel,
    block_1x128_rows_kernel,
    block_128x1_cols_kernel,
    block_128x128_kernel,
)
from megatron.core.fp8.cuda.triton_common import (  # noqa: F401
    grid_size,
    transpose_kernel,
)
from megatron.core.fp8.cuda.triton_mxfp8 import (  # noqa: F401
    mxfp8_dequantize_kernel,
    mxfp8_kernel,
    mxfp8_quads_kernel,
)
from megatron.core.fp8.cuda.triton_per_tensor import (  # noqa: F401
    amax_kernel,
    amax_partials_kernel,
    delayed_update_kernel,
    per_tensor_cast_kernel,
    piece_amax_kernel,
    piece_cast_kernel,
)
