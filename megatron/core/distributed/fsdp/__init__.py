"""Megatron-FSDP: sharded data parallelism over flat per-unit buffers (see docs/ARCHITECTURE.md).

The standalone API (`fully_shard_model`, `fully_shard_optimizer`, `fully_shard`,
`MixedPrecisionPolicy`, `quantized_model_init`) follows the `megatron_fsdp` package's.
"""

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.fully_shard import (
    MixedPrecisionPolicy,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
    quantized_model_init,
)
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

__all__ = [
    "FsdpConfig",
    "FullyShardedDataParallel",
    "MixedPrecisionPolicy",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "quantized_model_init",
]
