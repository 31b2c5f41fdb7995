"""Multi-latent attention (DeepSeek-V2/V3, Megatron-LM's MLASelfAttention) and its checks.

Per token x [hidden]:
    q      = linear_q_proj(x)                                   (q_lora_rank None)
           | linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))
             -> per head [q_nope: qk_head_dim | q_pe: qk_pos_emb_head_dim]
    [c_kv | k_pe] = linear_kv_down_proj(x)        (kv_lora_rank | qk_pos_emb_head_dim)
    [k_nope | v]  = linear_kv_up_proj(kv_layernorm(c_kv)) per head (qk_head_dim | v_head_dim)
    query = [q_nope | rot(q_pe)], key = [k_nope | rot(k_pe)] (k_pe one head, shared by all)
    out   = linear_proj(causal softmax(query key^T * scale) v)
rot is apply_rotary_interleaved_pairs; scale = m(s, mscale_all_dim)^2 / sqrt(qk + pos dims).
The latent norms are config.normalization with --qk-layernorm, identity without (as
Megatron-LM's specs). Every projection is a build_linear, so FP8 and Megatron-FSDP apply as
to any other Linear.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron.core.tensor_parallel import TensorParallel
from megatron.core.transformer.attention import RotaryCosSin, SelfAttention, run_core_attention
from megatron.core.transformer.linear import build_linear
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.recompute import recomputes
from megatron.core.transformer.rope import apply_rotary_interleaved_pairs, yarn_mscale
from megatron.core.transformer.transformer_config import TransformerConfig

# The widths FP8 GEMMs need divisible by 16 (as --hidden-size and --ffn-hidden-size).
FP8_DIM_MULTIPLE = 16


def _mla_widths(c: Any) -> dict[str, int]:
    """Flag(s) -> Linear in/out width that multi-latent attention builds from them."""
    heads = c.num_attention_heads
    widths = {
        "--kv-lora-rank": c.kv_lora_rank,
        "--kv-lora-rank + --qk-pos-emb-head-dim": c.kv_lora_rank + c.qk_pos_emb_head_dim,
        "--num-attention-heads x (--qk-head-dim + --qk-pos-emb-head-dim)": heads
        * (c.qk_head_dim + c.qk_pos_emb_head_dim),
        "--num-attention-heads x (--qk-head-dim + --v-head-dim)": heads
        * (c.qk_head_dim + c.v_head_dim),
        "--num-attention-heads x --v-head-dim": heads * c.v_head_dim,
    }
    if c.q_lora_rank is not None:
        widths["--q-lora-rank"] = c.q_lora_rank
    return widths


def mla_config_problem(c: Any, *, fp8: bool) -> str | None:
    """One line naming the flags and the fix when multi-latent attention or --qk-layernorm
    settings cannot work, else None. `c` is a TransformerConfig or the parsed flags (the same
    field names); `fp8`: an FP8 recipe is on."""
    if not c.multi_latent_attention:
        return None
    for flag, value in (
        ("--kv-lora-rank", c.kv_lora_rank),
        ("--qk-head-dim", c.qk_head_dim),
        ("--v-head-dim", c.v_head_dim),
    ):
        if value < 1:
            return f"{flag} {value} must be a positive width; DeepSeek-V3 uses 512, 128, 128."
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        return f"--q-lora-rank {c.q_lora_rank} must be positive; omit it for no q compression."
    pos = c.qk_pos_emb_head_dim
    if pos < 2 or pos % 2:
        return f"--qk-pos-emb-head-dim {pos} must be a positive even number (rotary pairs)."
    groups = c.num_query_groups
    if groups is not None and groups != c.num_attention_heads:
        return (
            f"--multi-latent-attention with --num-query-groups {groups}: multi-latent attention "
            "has no key/value groups (Megatron-LM refuses both); drop --group-query-attention."
        )
    if c.rotary_percent != 1.0:
        return (
            f"--multi-latent-attention rotates all --qk-pos-emb-head-dim channels; drop "
            f"--rotary-percent {c.rotary_percent}."
        )
    if not c.rotary_scaling_factor > 0:
        return f"--rotary-scaling-factor {c.rotary_scaling_factor} must be positive."
    if c.use_mup:
        return "--use-mup with --multi-latent-attention is not built; drop one of them."
    widths = _mla_widths(c).items() if fp8 else ()
    odd = [f"{flags} = {width}" for flags, width in widths if width % FP8_DIM_MULTIPLE]
    if odd:  # every such width in one line, so one fix covers them all
        return (
            f"{'; '.join(odd)}: not divisible by {FP8_DIM_MULTIPLE}, which FP8 GEMMs need; pick "
            "multiples of 16 or drop --fp8-recipe."
        )
    return None


def check_mla_config(config: TransformerConfig) -> None:
    """Raise ValueError with mla_config_problem's line."""
    problem = mla_config_problem(config, fp8=config.fp8 is not None)
    if problem is not None:
        raise ValueError(problem)


def _latent_norm(config: TransformerConfig, size: int) -> nn.Module:
    return build_norm(config, size) if config.qk_layernorm else nn.Identity()


def mla_softmax_scale(config: TransformerConfig) -> float:
    """m(s, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), as Megatron-LM."""
    factor = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return factor * factor / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class MultiLatentAttention(nn.Module):
    """Multi-latent self-attention (module docstring has the formulas). Parameter names are
    Megatron-LM's: linear_q_proj or linear_q_down_proj / q_layernorm / linear_q_up_proj,
    linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj. Output widths are
    head-major: channel c of head h sits at h * (per-head width) + c."""

    def __init__(self, config: TransformerConfig, *, layer_number: int) -> None:
        super().__init__()
        check_mla_config(config)
        self.num_heads = config.num_attention_heads
        self.qk_head_dim, self.v_head_dim = config.qk_head_dim, config.v_head_dim
        self.pos_dim, self.kv_lora_rank = config.qk_pos_emb_head_dim, config.kv_lora_rank
        self.softmax_scale = mla_softmax_scale(config)
        self.attention_dropout = config.attention_dropout
        self.selective_recompute = recomputes(config, "core_attn")

        def linear(fan_in: int, fan_out: int, bias: bool = False) -> nn.Module:
            return build_linear(
                fan_in, fan_out, bias=bias, config=config, layer_number=layer_number
            )

        hidden, heads = config.hidden_size, self.num_heads
        q_width = heads * (self.qk_head_dim + self.pos_dim)
        if config.q_lora_rank is None:
            self.linear_q_proj = linear(hidden, q_width)
        else:
            self.linear_q_down_proj = linear(hidden, config.q_lora_rank)
            self.q_layernorm = _latent_norm(config, config.q_lora_rank)
            self.linear_q_up_proj = linear(config.q_lora_rank, q_width)
        self.linear_kv_down_proj = linear(hidden, self.kv_lora_rank + self.pos_dim)
        self.kv_layernorm = _latent_norm(config, self.kv_lora_rank)
        self.linear_kv_up_proj = linear(
            self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim)
        )
        self.linear_proj = linear(heads * self.v_head_dim, hidden, bias=config.add_bias_linear)

    def _query(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "linear_q_proj"):
            return self.linear_q_proj(x_BSD)
        return self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x_BSD)))

    def forward(self, x_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin = None) -> torch.Tensor:
        if rotary_cos_sin is None:
            raise ValueError("multi-latent attention needs rotary (cos, sin) for its q_pe, k_pe")
        batch, seq, _ = x_BSD.shape
        heads, qk, pos, v_dim = self.num_heads, self.qk_head_dim, self.pos_dim, self.v_head_dim
        q_BHSD = self._query(x_BSD).view(batch, seq, heads, qk + pos).transpose(1, 2)
        c_kv, k_pe = torch.split(self.linear_kv_down_proj(x_BSD), [self.kv_lora_rank, pos], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(c_kv))
        kv_BHSD = kv.view(batch, seq, heads, qk + v_dim).transpose(1, 2)
        k_nope, v_BHSD = torch.split(kv_BHSD, [qk, v_dim], dim=-1)
        q_nope, q_pe = torch.split(q_BHSD, [qk, pos], dim=-1)
        cos, sin = rotary_cos_sin
        q_pe = apply_rotary_interleaved_pairs(q_pe, cos, sin)
        k_pe = apply_rotary_interleaved_pairs(k_pe.unsqueeze(1), cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(-1, heads, -1, -1)), dim=-1)
        context = run_core_attention(
            query,
            key,
            v_BHSD,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.softmax_scale,
            recompute=self.selective_recompute,
        )
        context_BSD = context.transpose(1, 2).reshape(batch, seq, heads * v_dim)
        return self.linear_proj(context_BSD)


def build_self_attention(
    config: TransformerConfig, *, layer_number: int, tensor_parallel: TensorParallel | None = None
) -> nn.Module:
    """MultiLatentAttention with --multi-latent-attention (not split over TP), else
    SelfAttention."""
    if config.multi_latent_attention:
        if tensor_parallel is not None:
            raise ValueError("multi-latent attention with tensor parallelism is not built")
        return MultiLatentAttention(config, layer_number=layer_number)
    return SelfAttention(config, layer_number=layer_number, tensor_parallel=tensor_parallel)
