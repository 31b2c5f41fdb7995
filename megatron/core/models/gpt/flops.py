"""Parameter and FLOP counts of a GPTModel, from the model or from its config alone."""

from __future__ import annotations

from torch import nn

from megatron.core.transformer.moe.config_checks import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; a tied embedding/output weight counts once (meta works)."""
    return sum(param.numel() for param in model.parameters())


def norm_parameters(config: TransformerConfig, width: int | None = None) -> int:
    # LayerNorm has a weight and a bias, RMSNorm only a weight.
    width = config.hidden_size if width is None else width
    return width * (2 if config.normalization == "LayerNorm" else 1)


def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _attention_parameters(config: TransformerConfig) -> int:
    """One attention block: QKV and output projections (standard), or the latent projections
    and their norms (multi-latent attention); the per-head q/k norms of --qk-layernorm."""
    hidden, bias, heads = config.hidden_size, config.add_bias_linear, config.num_attention_heads
    if not config.multi_latent_attention:
        heads_width = heads * config.kv_channels
        qkv_width = heads_width + 2 * config.num_query_groups * config.kv_channels
        qk_norms = 2 * norm_parameters(config, config.kv_channels) if config.qk_layernorm else 0
        return _linear(hidden, qkv_width, bias) + _linear(heads_width, hidden, bias) + qk_norms

    def latent_norm(width: int) -> int:
        return norm_parameters(config, width) if config.qk_layernorm else 0

    q_rank, kv_rank, pos = config.q_lora_rank, config.kv_lora_rank, config.qk_pos_emb_head_dim
    q_width = heads * (config.qk_head_dim + pos)
    if q_rank is None:
        query = _linear(hidden, q_width, False)
    else:
        query = _linear(hidden, q_rank, False) + latent_norm(q_rank)
        query += _linear(q_rank, q_width, False)
    key_value = _linear(hidden, kv_rank + pos, False) + latent_norm(kv_rank)
    key_value += _linear(kv_rank, heads * (config.qk_head_dim + config.v_head_dim), False)
    return query + key_value + _linear(heads * config.v_head_dim, hidden, bias)


def _attention_core_width(config: TransformerConfig) -> int:
    """The widths QK^T and PV multiply over, added: heads x (query-key dim + value dim)."""
    heads = config.num_attention_heads
    if config.multi_latent_attention:
        return heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim)
    return 2 * heads * config.kv_channels


def _mlp_parameters(config: TransformerConfig, ffn: int) -> int:
    """One MLP (dense, expert or shared expert) of FFN width `ffn`: fc1 (gate and up with
    SwiGLU) and fc2, with their biases."""
    fc1_width = ffn * (2 if config.swiglu else 1)
    bias = config.add_bias_linear
    return _linear(config.hidden_size, fc1_width, bias) + _linear(ffn, config.hidden_size, bias)


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
    """Parameters of one TransformerLayer: two norms, the attention block and the MLP (fc1,
    fc2); with `moe_experts`, an MoE MLP counting that many routed experts."""
    if moe_experts is None:
        mlp = _mlp_parameters(config, config.ffn_hidden_size)
    else:
        mlp = _moe_mlp_parameters(config, experts=moe_experts)
    return 2 * norm_parameters(config) + _attention_parameters(config) + mlp


def _decoder_parameters(config: TransformerConfig, *, active: bool) -> int:
    """Every layer's parameters, and the multi-token-prediction modules' (three norms, eh_proj
    and a layer shaped as the last one). MoE layers count all routed experts, or with `active`
    the top-k a token is routed to (the ones it multiplies by)."""
    experts = config.moe_router_topk if active else config.num_moe_experts
    pattern = moe_layer_pattern(config)
    layers = [layer_parameters(config, moe_experts=experts if moe else None) for moe in pattern]
    mtp_module = 3 * norm_parameters(config) + 2 * config.hidden_size**2 + layers[-1]
    return sum(layers) + (config.mtp_num_layers or 0) * mtp_module


def count_parameters_from_config(config: TransformerConfig) -> int:
    """What `count_parameters(GPTModel(config))` returns, without building the model."""
    embedding = config.vocab_size * config.hidden_size
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_sequence_length * config.hidden_size
    output_head = 0
    if config.untie_embeddings_and_output_weights:
        output_head = config.vocab_size * config.hidden_size
    decoder = _decoder_parameters(config, active=False) + norm_parameters(config)
    return embedding + decoder + output_head


def num_floating_point_operations(
    config: TransformerConfig, *, batch_size: int, seq_length: int
) -> float:
    """Model FLOPs of one forward + backward pass over batch_size x seq_length tokens.

    FLOPs = B * S * (6 * N_matmul + 3 * L' * W * S), where
      N_matmul = the layers' parameters + final-norm parameters + (1 + MTP depth) * V * D: the
        parameters a token multiplies by (an MoE layer: its router, its top-k routed experts,
        its shared experts; each multi-token-prediction depth: its module and the head again).
        The output head's V * D counts whether tied or not (its GEMM runs either way);
        embedding and position tables are lookups and do not count.
      3 * L' * W * S: causal attention over L' = layers + MTP depth, W = heads x (query-key dim
        + value dim) (2 * num_attention_heads * kv_channels for standard attention): QK^T and
        PV cost 2 * S * W per token forward, halved by the causal mask, times 3 for forward +
        backward.
    Each multiply-add is 2 FLOPs, backward is twice forward, hence 6 = 2 * (1 + 2).
    """
    if batch_size < 1 or seq_length < 1:
        raise ValueError(f"batch_size={batch_size} and seq_length={seq_length} must be >= 1")
    depth = config.mtp_num_layers or 0
    matmul_parameters = (
        _decoder_parameters(config, active=True)
        + norm_parameters(config)
        + (1 + depth) * config.vocab_size * config.hidden_size
    )
    attention = 3 * (config.num_layers + depth) * _attention_core_width(config) * seq_length
    per_token = 6 * matmul_parameters + attention
    return float(batch_size * seq_length * per_token)
