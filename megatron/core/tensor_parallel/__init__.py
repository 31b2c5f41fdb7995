"""Tensor and sequence parallelism: the autograd collectives (`mappings`), the
column/row-parallel Linears and the vocab-parallel embedding (`layers`), and the
vocab-parallel cross-entropy (`cross_entropy`). Groups are passed in, never read from globals.
"""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    TensorParallelGrads,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    column_parallel_matmul,
    mark_replicated_sequence_parallel_,
    tensor_parallel_placement,
    tensor_parallel_shards,
)
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallel",
    "TensorParallelGrads",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "column_parallel_matmul",
    "mark_replicated_sequence_parallel_",
    "scatter_to_sequence_parallel_region",
    "tensor_parallel_placement",
    "tensor_parallel_shards",
    "vocab_parallel_cross_entropy",
]
