"""muP (maximal update parametrization) as Megatron-LM core_v0.19.0 defines it.

With use_mup, width mult m = hidden_size / mup_base_hidden_size (default base: hidden_size, m 1):
- init: hidden Linears std / sqrt(m); the residual-output Linears (linear_proj, linear_fc2)
  std / sqrt(2 L) / sqrt(m); embeddings and an untied output layer keep the base std;
- attention: softmax scale sqrt(mup_base_head_dim, or 1) / kv_channels ** mup_attn_scale_power
  (1 / d_head at the default power 1) instead of 1 / sqrt(d_head);
- logits times mup_output_mult (1 / m when left at 1.0), embedding output times
  mup_embedding_mult;
- Adam: hidden matrix params (2-D and more, not embeddings/output layer) at lr / m (peak and
  floor) and eps / m; vector-like params, embeddings and the output layer keep the base values
  (megatron.core.optimizer.optimizer.mup_group_overrides).
Without use_mup every function here returns the standard parametrization's value.
"""

from __future__ import annotations

import math

from megatron.core.transformer.transformer_config import TransformerConfig


def width_mult(config: TransformerConfig) -> float:
    """hidden_size / mup_base_hidden_size under muP, else 1."""
    if not config.use_mup or config.mup_base_hidden_size is None:
        return 1.0
    return config.hidden_size / config.mup_base_hidden_size


def softmax_scale(config: TransformerConfig) -> float | None:
    """Attention's softmax scale; None means scaled_dot_product_attention's 1 / sqrt(d)."""
    if not config.use_mup:
        return None
    base = 1.0 if config.mup_base_head_dim is None else config.mup_base_head_dim**0.5
    return base / (config.kv_channels**config.mup_attn_scale_power)


def output_mult(config: TransformerConfig) -> float:
    """Multiplier of the logits: mup_output_mult, or 1 / m when it is left at 1.0."""
    if not config.use_mup:
        return 1.0
    mult = width_mult(config)
    if config.mup_output_mult == 1.0 and mult != 1.0:
        return 1.0 / mult
    return config.mup_output_mult


def embedding_mult(config: TransformerConfig) -> float:
    """Multiplier of the embedding output (before its dropout)."""
    return config.mup_embedding_mult if config.use_mup else 1.0


def init_std(config: TransformerConfig, *, residual_output: bool, embedding: bool) -> float:
    """Std of a weight's normal init: residual-output Linears, embedding-class weights
    (embeddings, untied output layer) or other hidden weights."""
    std = config.init_method_std
    if residual_output:
        std = std / math.sqrt(2.0 * config.num_layers)
    if config.use_mup and not embedding:
        std = std / math.sqrt(width_mult(config))
    return std
