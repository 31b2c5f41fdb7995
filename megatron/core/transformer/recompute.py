"""Selective activation recompute (Megatron-LM's --recompute-modules): which submodules run
under activation checkpoint, and the one way they are run. A recomputed submodule keeps only
its inputs; its forward runs again in backward with the RNG state of the first run (dropout
draws the same masks); FP8 Linears and MoE routers recognise the rerun and record nothing
twice (fp8/autocast.in_recompute, moe/router.py)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatron.core.transformer.transformer_config import TransformerConfig

# The submodules built here, by Megatron-LM's names: the ones it recomputes by checkpointing
# their forward (its layernorm, moe_act and mla_up_proj drop an output instead: not built).
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")


def recomputes(config: TransformerConfig, module: str) -> bool:
    """Whether selective recompute runs `module` (of RECOMPUTE_MODULES) under checkpoint."""
    return config.recompute_granularity == "selective" and module in config.recompute_modules


def recompute_or_run(recompute: bool, function, *args):
    """function(*args) (a submodule, or the attention core), under activation checkpoint when
    `recompute` and grad is on."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(function, *args, use_reentrant=False)
    return function(*args)
