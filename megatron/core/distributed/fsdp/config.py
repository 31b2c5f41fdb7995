"""Megatron-FSDP settings, one dataclass built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")


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

    gradient_accumulation_fusion: bool = True
    """FP8 weights' wgrad GEMMs write their grads into the grad buffers (in fp32, or the
    buffer's bf16) instead of returning a bf16 grad for a cast pass
    (`--no-gradient-accumulation-fusion` turns it off, as in Megatron-LM)."""

    outer_dp_sharding_strategy: Literal["no_shard", "optim"] = "no_shard"
    """HSDP only (a mesh with an outer dimension): what is sharded across the replicas.
    no_shard: each replica holds the whole sharded state; grads are all-reduced over the outer
    group. optim: the optimizer state (Adam moments) is split across the replicas as well;
    grads are reduce-scattered over the outer group and the updated fp32 main params
    all-gathered over it. Megatron-FSDP's `--outer-dp-sharding-strategy`."""

    def __post_init__(self) -> None:
        if self.outer_dp_sharding_strategy not in OUTER_SHARDING_STRATEGIES:
            raise ValueError(
                f"outer_dp_sharding_strategy={self.outer_dp_sharding_strategy!r}: use one of "
                f"{OUTER_SHARDING_STRATEGIES}"
            )

    @property
    def outer_shards_optimizer(self) -> bool:
        return self.outer_dp_sharding_strategy == "optim"

    @property
    def shards_optimizer_state(self) -> bool:
        return self.data_parallel_sharding_strategy != "no_shard"

    @property
    def shards_grads(self) -> bool:
        return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.data_parallel_sharding_strategy == "optim_grads_params"
