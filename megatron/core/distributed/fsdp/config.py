"""Megatron-FSDP settings, one dataclass built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(kw_only=True)
class FsdpConfig:
    """How Megatron-FSDP shards and communicates. Flag names follow Megatron-LM."""

    data_parallel_sharding_strategy: Literal[
        "no_shard", "optim", "optim_grads", "optim_grads_params"
    ] = "optim_grads_params"
    """What is sharded across data-parallel ranks: nothing; main params and optimizer state;
    plus grads; plus the compute params themselves (ZeRO-3)."""

    overlap_param_gather: bool = False
    """Prefetch the next unit's all-gather while the current unit computes."""

    overlap_grad_reduce: bool = False
    """Reduce-scatter each unit's grads asynchronously as soon as its backward is done."""

    suggested_communication_unit_size: int | None = None
    """Upper bound, in elements, of parameters whose gathers may be in flight at once."""

    main_params_dtype: torch.dtype = torch.float32
    """Dtype of the optimizer's main parameters (`--main-params-dtype`)."""

    main_grads_dtype: torch.dtype = torch.float32
    """Dtype of the gradient buffers (`--main-grads-dtype`)."""

    grad_reduce_in_bf16: bool = False
    """Reduce-scatter gradients in bf16 instead of main_grads_dtype (`--grad-reduce-in-bf16`)."""

    init_model_with_meta_device: bool = False
    """Build the model on the meta device and materialize it shard by shard."""

    @property
    def shards_optimizer_state(self) -> bool:
        return self.data_parallel_sharding_strategy != "no_shard"

    @property
    def shards_grads(self) -> bool:
        return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.data_parallel_sharding_strategy == "optim_grads_params"
