"""Builds the model and its optimizer for the chosen data-parallel engine.

This is the one place that decides how the plain GPTModel is wrapped: torch DDP (replicated),
or Megatron-FSDP through its adapter. The training loop only sees ModelAndOptimizer.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron.core.models.gpt import GPTModel, count_parameters, num_floating_point_operations
from megatron.core.optimizer import MegatronOptimizer, MixedPrecisionOptimizer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.configs import build_fsdp_config, build_optimizer_config
from megatron.training.initialize import DistributedEnv


@dataclass
class ModelAndOptimizer:
    model: nn.Module
    """What forward is called on: the wrapped model (DDP or Megatron-FSDP) or the plain one."""
    module: GPTModel
    """The plain GPTModel underneath."""
    optimizer: MegatronOptimizer
    config: TransformerConfig
    flops_per_iteration: float
    num_parameters: int
    fp8_context: Callable[[], contextlib.AbstractContextManager] = field(
        default=contextlib.nullcontext
    )

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip cross-rank grad reduction for a non-final micro-batch, where the engine can."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        finish = getattr(self.model, "finish_grad_sync", None)
        if finish is not None:
            finish()


def _fp8_context_factory(config: TransformerConfig, env: DistributedEnv) -> Callable:
    if config.fp8 is None:
        return contextlib.nullcontext
    from megatron.core.fp8 import fp8_autocast

    return lambda: fp8_autocast(
        enabled=True, fp8_config=config.fp8, amax_reduction_group=env.dp_group
    )


def compile_layers(module: GPTModel) -> None:
    """Regional compile: each transformer layer's forward goes through torch.compile.

    Only `forward` is compiled, not the module call, so the FSDP engine's forward hooks (its
    gathers and releases) run eagerly around the compiled region. Every layer runs the same
    code object and its parameters are graph inputs (dynamo inlines nn.Modules), so identical
    layers share one compiled graph instead of compiling once each. This is the third step of
    the model-setup seam: FP8 conversion (the Linear factory, at construction), activation
    recompute (TransformerConfig, read by the block), compile, then sharding.
    """
    for layer in module.decoder.layers:
        layer.forward = torch.compile(layer.forward)


def _build_ddp(config: TransformerConfig, *, args: argparse.Namespace, env: DistributedEnv):
    module = GPTModel(config, seed=args.seed).to(env.device)
    if args.torch_compile:
        compile_layers(module)
    model: nn.Module = module
    if env.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=env.dp_group,
            broadcast_buffers=False,
        )
    optimizer = MixedPrecisionOptimizer(module, config=build_optimizer_config(args))
    return model, module, optimizer


def _build_megatron_fsdp(
    config: TransformerConfig, *, args: argparse.Namespace, env: DistributedEnv
):
    from megatron.core.distributed.data_parallel_mesh import DP_OUTER_DIM, DP_SHARD_DIM
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.transformer.init import init_parameter_

    fsdp_config = build_fsdp_config(args)
    if fsdp_config.init_model_with_meta_device:
        with torch.device("meta"):
            module = GPTModel(config, seed=args.seed)
    else:
        module = GPTModel(config, seed=args.seed).to(env.device)
    if args.torch_compile:
        compile_layers(module)
    model = FullyShardedDataParallel(
        module,
        fsdp_config=fsdp_config,
        # Inner (shard) and, with --num-distributed-optimizer-instances > 1, outer groups.
        device_mesh=env.dp_mesh,
        dp_shard_dim=DP_SHARD_DIM,
        dp_outer_dim=DP_OUTER_DIM,
        device=env.device,
        init_fn=lambda name, tensor: init_parameter_(
            tensor, name=name, config=config, seed=args.seed
        ),
        # With fp8_param_gather the engine keeps Fp8Linear weights only as FP8 bytes plus fp32
        # main shards, seeded from the exact high-precision values.
        fp8_config=config.fp8,
    )
    optimizer = model.build_optimizer(build_optimizer_config(args))
    return model, module, optimizer


def setup_model_and_optimizer(
    args: argparse.Namespace, *, config: TransformerConfig, env: DistributedEnv
) -> ModelAndOptimizer:
    build = _build_megatron_fsdp if args.use_megatron_fsdp else _build_ddp
    model, module, optimizer = build(config, args=args, env=env)
    return ModelAndOptimizer(
        model=model,
        module=module,
        optimizer=optimizer,
        config=config,
        flops_per_iteration=num_floating_point_operations(
            config, batch_size=args.global_batch_size, seq_length=args.seq_length
        ),
        num_parameters=count_parameters(module),
        fp8_context=_fp8_context_factory(config, env),
    )
