"""Sharded checkpoints on torch.distributed.checkpoint, loadable at any data-parallel size."""

from megatron.core.dist_checkpointing.export import load_full_model_params
from megatron.core.dist_checkpointing.serialization import load, save

__all__ = ["load", "load_full_model_params", "save"]
