"""Megatron-FSDP for plain PyTorch users, without Megatron's configs or training loop.

model = fully_shard_model(model, fsdp_unit_modules=(MyBlock,), zero_dp_strategy=3)
optimizer = fully_shard_optimizer(model, {"lr": 1e-3, "weight_decay": 0.1})
loss = model(x).mean(); loss.backward()
model.finish_grad_sync(); optimizer.step(); model.zero_grad_buffer()
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.distributed_optimizer import FsdpDistributedOptimizer
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.param_and_grad_buffer import InitFn
from megatron.core.optimizer import OptimizerConfig

# ZeRO stage number -> Megatron-FSDP strategy name.
_ZERO_STAGES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def _strategy(zero_dp_strategy: int | str) -> str:
    if isinstance(zero_dp_strategy, int):
        if zero_dp_strategy not in _ZERO_STAGES:
            raise ValueError(f"zero_dp_strategy={zero_dp_strategy}: use 0, 1, 2 or 3")
        return _ZERO_STAGES[zero_dp_strategy]
    if zero_dp_strategy not in _ZERO_STAGES.values():
        raise ValueError(
            f"zero_dp_strategy={zero_dp_strategy!r}: use one of {sorted(_ZERO_STAGES.values())}"
        )
    return zero_dp_strategy


def fully_shard_model(
    module: nn.Module,
    *,
    fsdp_unit_modules: tuple[type, ...],
    zero_dp_strategy: int | str = 3,
    init_model_with_meta_device: bool = False,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    init_fn: InitFn | None = None,
    **fsdp_config_overrides: Any,
) -> FullyShardedDataParallel:
    """Wrap `module`; each `fsdp_unit_modules` instance is one gather/reduce unit.

    With init_model_with_meta_device the module was built on meta and `init_fn(name, tensor)`
    fills each full parameter once, on the target device, one at a time.
    """
    config = FsdpConfig(
        data_parallel_sharding_strategy=_strategy(zero_dp_strategy),
        init_model_with_meta_device=init_model_with_meta_device,
        **fsdp_config_overrides,
    )
    return FullyShardedDataParallel(
        module,
        fsdp_config=config,
        process_group=process_group,
        device=device,
        fsdp_unit_modules=fsdp_unit_modules,
        init_fn=init_fn,
    )


def fully_shard_optimizer(
    model: FullyShardedDataParallel, optimizer_config_or_kwargs: OptimizerConfig | dict[str, Any]
) -> FsdpDistributedOptimizer:
    """The distributed optimizer over `model`'s main-param shards.

    Accepts an OptimizerConfig or its fields as a dict, e.g. {"lr": 1e-3, "clip_grad": 1.0}.
    """
    config = optimizer_config_or_kwargs
    if isinstance(config, dict):
        known = {f.name for f in fields(OptimizerConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"fully_shard_optimizer: unknown options {unknown}; use {sorted(known)}"
            )
        config = OptimizerConfig(**config)
    return model.build_optimizer(config)
