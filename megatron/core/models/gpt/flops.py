"""Parameter and FLOP counts of a GPTModel, from the model or from its config alone."""

from __future__ import annotations

from torch import nn

from megatron.core.transformer.moe.config_checks import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; a tied embedding/output weight counts once (meta works)."""
    return sum(param.numel() for param in model.parameters())


def _norm_parameters(config: TransformerConfig) -> int:
    # LayerNorm has a weight and a bias, RMSNorm only a weight.
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def _mlp_parameters(config: TransformerConfig, ffn: int) -> int:
    """One MLP (dense, expert or shared expert) of FFN width `ffn`: fc1 (gate and up with
    SwiGLU) and fc2, with their biases."""
    hidden, bias = config.hidden_size, 1 if config.add_bias_linear else 0
    fc1_width = ffn * (2 if config.swiglu else 1)
    return hidden * fc1_width + bias * fc1_width + ffn * hidden + bias * hidden


def _moe_mlp_parameters(config: TransformerConfig, *, experts: int) -> int:
    """An MoE MLP with `experts` of its routed experts counted: the router, those experts, the
    shared experts and their gate."""
    hidden = config.hidden_size
    total = config.num_moe_experts * hidden + experts * _mlp_parameters(
        config, config.moe_ffn_hidden_size
    )
    shared = config.moe_shared_expert_intermediate_size
    if shared:
        total += _mlp_parameters(config, shared) + (hidden if config.moe_shared_expert_gate else 0)
    return total


def layer_parameters(config: TransformerConfig, *, moe_experts: int | None = None) -> int:
    """Parameters of one TransformerLayer: two norms, QKV, output projection, and the MLP
    (fc1, fc2); with `moe_experts`, an MoE MLP counting that many routed experts."""
    hidden = config.hidden_size
    qkv_width = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
    attention_width = config.num_attention_heads * config.kv_channels
    bias = 1 if config.add_bias_linear else 0
    linear_qkv = hidden * qkv_width + bias * qkv_width
    linear_proj = attention_width * hidden + bias * hidden
    if moe_experts is None:
        mlp = _mlp_parameters(config, config.ffn_hidden_size)
    else:
        mlp = _moe_mlp_parameters(config, experts=moe_experts)
    return 2 * _norm_parameters(config) + linear_qkv + linear_proj + mlp


def _decoder_parameters(config: TransformerConfig, *, active: bool) -> int:
    """Every layer's parameters; MoE layers count all routed experts, or with `active` the
    top-k a token is routed to (the ones it multiplies by)."""
    experts = config.moe_router_topk if active else config.num_moe_experts
    return sum(
        layer_parameters(config, moe_experts=experts if moe else None)
        for moe in moe_layer_pattern(config)
    )


def count_parameters_from_config(config: TransformerConfig) -> int:
    """What `count_parameters(GPTModel(config))` returns, without building the model."""
    embedding = config.vocab_size * config.hidden_size
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_sequence_length * config.hidden_size
    output_head = 0
    if config.untie_embeddings_and_output_weights:
        output_head = config.vocab_size * config.hidden_size
    decoder = _decoder_parameters(config, active=False) + _norm_parameters(config)
    return embedding + decoder + output_head


def num_floating_point_operations(
    config: TransformerConfig, *, batch_size: int, seq_length: int
) -> float:
    """Model FLOPs of one forward + backward pass over batch_size x seq_length tokens.

    FLOPs = B * S * (6 * N_matmul + 6 * L * A * S), where
      N_matmul = the layers' parameters + final-norm parameters + V * D: the parameters a token
        multiplies by (an MoE layer: its router, its top-k routed experts, its shared
        experts). The output head's V * D counts whether tied or not (its GEMM runs either
        way); embedding and position tables are lookups and do not count.
      6 * L * A * S: causal attention, A = num_attention_heads * kv_channels (= hidden size
        unless kv_channels is set): QK^T and PV cost 2 * 2 * S * A per token forward, halved by
        the causal mask, times 3 for forward + backward.
    Each multiply-add is 2 FLOPs, backward is twice forward, hence 6 = 2 * (1 + 2).
    """
    if batch_size < 1 or seq_length < 1:
        raise ValueError(f"batch_size={batch_size} and seq_length={seq_length} must be >= 1")
    matmul_parameters = (
        _decoder_parameters(config, active=True)
        + _norm_parameters(config)
        + config.vocab_size * config.hidden_size
    )
    attention_width = config.num_attention_heads * config.kv_channels
    per_token = 6 * matmul_parameters + 6 * config.num_layers * attention_width * seq_length
    return float(batch_size * seq_length * per_token)
