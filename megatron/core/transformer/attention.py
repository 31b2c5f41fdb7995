"""Causal self-attention with grouped-query attention and one fused QKV Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import TensorParallel
from megatron.core.transformer import mup
from megatron.core.transformer.linear import build_linear
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.recompute import recompute_or_run, recomputes
from megatron.core.transformer.rope import apply_rotary
from megatron.core.transformer.transformer_config import TransformerConfig

RotaryCosSin = tuple[torch.Tensor, torch.Tensor] | None


def core_attention(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    dropout_p: float,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v with dropout on the probabilities; scale None is
    1 / sqrt(d) (muP sets its own: megatron.core.transformer.mup.softmax_scale).

    Query head h reads key/value group h // (heads / groups), the same grouping as
    HuggingFace's repeat_kv and SDPA's enable_gqa.
    """
    heads, groups = q_BHSD.shape[1], k_BGSD.shape[1]
    enable_gqa = False
    if heads != groups:
        if q_BHSD.is_cuda and q_BHSD.dtype in (torch.float16, torch.bfloat16):
            # Only the CUDA flash kernel reads grouped k/v natively; elsewhere enable_gqa
            # falls back to the math kernel, so repeat k/v and keep the fused kernels.
            enable_gqa = True
        else:
            k_BGSD = k_BGSD.repeat_interleave(heads // groups, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(heads // groups, dim=1)
    return F.scaled_dot_product_attention(
        q_BHSD,
        k_BGSD,
        v_BGSD,
        dropout_p=dropout_p,
        is_causal=True,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def run_core_attention(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    *,
    dropout_p: float,
    scale: float | None,
    recompute: bool,
) -> torch.Tensor:
    """core_attention, under checkpoint when `recompute` (selective recompute) and grad is on.

    Only the S x S attention core is recomputed: it holds the largest activations
    (probabilities) and is cheap next to the Linears. Checkpoint restores the RNG state, so
    attention dropout draws the same mask on recompute."""
    return recompute_or_run(recompute, core_attention, q_BHSD, k_BGSD, v_BGSD, dropout_p, scale)


class SelfAttention(nn.Module):
    """Fused QKV projection, optional rotary, causal SDPA, output projection.

    Output dim layout of `linear_qkv` (for exporters):
        [ q: num_attention_heads * kv_channels
        | k: num_query_groups * kv_channels
        | v: num_query_groups * kv_channels ]
    and inside each block head-major: channel c of head h sits at h * kv_channels + c.
    With --qk-layernorm, `q_layernorm` and `k_layernorm` (config.normalization over
    kv_channels, shared by all heads) normalize each query and key head before rotary, as in
    Megatron-LM.
    With `tensor_parallel`, rank r holds heads and query groups r of tp, [q_r | k_r | v_r],
    and the projection is row-parallel.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        layer_number: int,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp_size = 1 if tensor_parallel is None else tensor_parallel.size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        self.softmax_scale = mup.softmax_scale(config)
        self.attention_dropout = config.attention_dropout
        self.selective_recompute = recomputes(config, "core_attn")
        self.q_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        q_width = config.num_attention_heads * self.head_dim
        kv_width = config.num_query_groups * self.head_dim
        self.linear_qkv = build_linear(
            config.hidden_size,
            q_width + 2 * kv_width,
            bias=config.add_bias_linear,
            config=config,
            layer_number=layer_number,
            parallel="column",
            tensor_parallel=tensor_parallel,
            output_blocks=[q_width, kv_width, kv_width],
        )
        self.linear_proj = build_linear(
            q_width,
            config.hidden_size,
            bias=config.add_bias_linear,
            config=config,
            layer_number=layer_number,
            parallel="row",
            tensor_parallel=tensor_parallel,
        )

    def forward(self, x_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin = None) -> torch.Tensor:
        qkv = self.linear_qkv(x_BSD)
        batch, seq, _ = qkv.shape  # the full sequence also under sequence parallelism
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_groups * self.head_dim
        q, k, v = torch.split(qkv, [q_width, kv_width, kv_width], dim=-1)
        q_BHSD = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGSD = k.view(batch, seq, self.num_groups, self.head_dim).transpose(1, 2)
        v_BGSD = v.view(batch, seq, self.num_groups, self.head_dim).transpose(1, 2)
        if self.q_layernorm is not None:
            q_BHSD = self.q_layernorm(q_BHSD)
            k_BGSD = self.k_layernorm(k_BGSD)
        if rotary_cos_sin is not None:
            cos, sin = rotary_cos_sin
            q_BHSD = apply_rotary(q_BHSD, cos, sin)
            k_BGSD = apply_rotary(k_BGSD, cos, sin)
        context = run_core_attention(
            q_BHSD,
            k_BGSD,
            v_BGSD,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.softmax_scale,
            recompute=self.selective_recompute,
        )
        context_BSD = context.transpose(1, 2).reshape(batch, seq, q_width)
        return self.linear_proj(context_BSD)
