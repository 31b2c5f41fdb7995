"""Rotary position embeddings, Llama/GPT-NeoX "rotate_half" convention (HuggingFace layout).

Channel i of the rotated slice pairs with channel i + rotary_dim/2 (not with i+1 as in the
interleaved GPT-J layout), so HuggingFace Llama q/k weights map 1:1 onto ours. With
rotary_percent < 1 only the first rotary_dim channels of each head rotate; the rest pass through.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatron.core.transformer.transformer_config import TransformerConfig


def rotary_dim(config: TransformerConfig) -> int:
    """Channels per head that rotate: kv_channels * rotary_percent, which must be even."""
    dim = int(config.kv_channels * config.rotary_percent)
    if not 0.0 < config.rotary_percent <= 1.0 or dim < 2 or dim % 2 != 0:
        raise ValueError(
            f"rotary_percent={config.rotary_percent} with kv_channels={config.kv_channels} gives "
            f"{dim} rotary channels; it must be a positive even number, so pick rotary_percent "
            "in (0, 1] such that kv_channels * rotary_percent is even"
        )
    return dim


def rotary_inverse_frequencies(
    dim: int, base: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """theta_i = base^(-2i/dim) for i < dim/2, fp32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base**exponents)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's m(s, mscale) = 0.1 * mscale * ln(s) + 1 for s > 1, else 1 (Megatron-LM's
    _yarn_get_mscale)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(
    dim: int, config: TransformerConfig, device: torch.device | str | None = None
) -> torch.Tensor:
    """YaRN's blend of the base frequencies theta_i and the interpolated theta_i / s: channels
    pairs that rotate fewer than beta_slow times over original_max_position_embeddings take
    the interpolated one, more than beta_fast times the base one, a linear ramp in between."""
    base, scale = float(config.rotary_base), config.rotary_scaling_factor
    extrapolated = rotary_inverse_frequencies(dim, base, device=device)
    interpolated = extrapolated / scale

    def correction_dim(rotations: float) -> float:
        turns = config.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pair = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = ((pair - low) / (high - low)).clamp(0.0, 1.0)
    keep_base = 1.0 - ramp
    return interpolated * (1.0 - keep_base) + extrapolated * keep_base


def rotary_attention_factor(config: TransformerConfig) -> float:
    """What cos and sin are multiplied by: m(s, mscale) / m(s, mscale_all_dim) with yarn, else
    1 (YaRN's concentration factor, as Megatron-LM)."""
    if config.rope_type != "yarn":
        return 1.0
    scale = config.rotary_scaling_factor
    return yarn_mscale(scale, config.mscale) / yarn_mscale(scale, config.mscale_all_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x ([B, heads, S, d]) in fp32.

    cos, sin: [B, 1, S, rotary_dim] (already duplicated as [freqs | freqs]).
    """
    dim = cos.shape[-1]
    x_rot = x[..., :dim].float()
    rotated = (x_rot * cos + rotate_half(x_rot) * sin).to(x.dtype)
    if dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., dim:]), dim=-1)


def apply_rotary_interleaved_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Multi-latent attention's rotary (Megatron-LM's mla_rotary_interleaved): the pairs are
    channels (2i, 2i+1), so x is first reordered to [even channels | odd channels] and then
    rotated as apply_rotary does; the output stays in that order (q and k get the same order,
    so their dot products are unchanged)."""
    dim = cos.shape[-1]
    head = torch.cat((x[..., 0:dim:2], x[..., 1:dim:2]), dim=-1)
    return apply_rotary(torch.cat((head, x[..., dim:]), dim=-1), cos, sin)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies and turns position ids into (cos, sin).

    Rotary width: rotary_dim(config), or qk_pos_emb_head_dim with multi-latent attention.
    With rope_type yarn the frequencies are yarn_inverse_frequencies and cos, sin are
    multiplied by rotary_attention_factor (Megatron-LM's YarnRotaryEmbedding).

    `inv_freq` is a non-persistent fp32 buffer: it is not in the state dict. `init_buffers`
    recomputes it; moves (`to_empty`, `to`, dtype casts) recompute it automatically.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.dim = config.qk_pos_emb_head_dim if config.multi_latent_attention else None
        if self.dim is None:
            self.dim = rotary_dim(config)
        self.base = float(config.rotary_base)
        self.attention_factor = rotary_attention_factor(config)
        self.register_buffer("inv_freq", self._inverse_frequencies(None), persistent=False)

    def _inverse_frequencies(self, device: torch.device | str | None) -> torch.Tensor:
        if self.config.rope_type == "yarn":
            return yarn_inverse_frequencies(self.dim, self.config, device=device)
        return rotary_inverse_frequencies(self.dim, self.base, device=device)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create `inv_freq` on `device` (default: where it lives now)."""
        if device is None:
            device = self.inv_freq.device
        self.inv_freq = self._inverse_frequencies(device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # Every device/dtype move (`to`, `to_empty`, `cuda`, `bfloat16`) goes through _apply:
        # recompute the frequencies afterwards so they are never uninitialized memory after
        # to_empty and never rounded to bf16 by a dtype cast.
        result = super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.init_buffers(self.inv_freq.device)
        return result

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> (cos, sin), each [B, 1, S, rotary_dim] fp32."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()
