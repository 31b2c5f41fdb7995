"""Megatron-FSDP: sharded data parallelism over flat per-unit buffers (see docs/ARCHITECTURE.md)."""

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.fully_shard import fully_shard_model, fully_shard_optimizer
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

__all__ = ["FsdpConfig", "FullyShardedDataParallel", "fully_shard_model", "fully_shard_optimizer"]
