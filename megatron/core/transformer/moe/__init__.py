"""Mixture of Experts: router, token dispatch with expert parallelism, grouped experts,
shared experts, and the MoE layer that replaces a layer's MLP (Megatron-LM's semantics)."""

from megatron.core.transformer.moe.config_checks import check_moe_config, moe_layer_pattern
from megatron.core.transformer.moe.experts import GroupedExperts, grouped_gemm
from megatron.core.transformer.moe.metrics import MoEMetrics
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter, update_expert_biases

__all__ = [
    "GroupedExperts",
    "MoELayer",
    "MoEMetrics",
    "TopKRouter",
    "check_moe_config",
    "grouped_gemm",
    "moe_layer_pattern",
    "update_expert_biases",
]
