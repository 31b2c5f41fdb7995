"""Rotary position embeddings, Llama/GPT-NeoX "rotate_half" convention (HuggingFace layout).

Channel i of the rotated slice pairs with channel i + rotary_dim/2 (not with i+1 as in the
interleaved GPT-J layout), so HuggingFace Llama q/k weights map 1:1 onto ours. With
rotary_percent < 1 only the first rotary_dim channels of each head rotate; the rest pass through.
"""

from __future__ import annotations

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


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies and turns position ids into (cos, sin).

    `inv_freq` is a non-persistent fp32 buffer: it is not in the state dict. `init_buffers`
    recomputes it; moves (`to_empty`, `to`, dtype casts) recompute it automatically.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dim = rotary_dim(config)
        self.base = float(config.rotary_base)
        self.register_buffer(
            "inv_freq", rotary_inverse_frequencies(self.dim, self.base), persistent=False
        )

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create `inv_freq` on `device` (default: where it lives now)."""
        if device is None:
            device = self.inv_freq.device
        self.inv_freq = rotary_inverse_frequencies(self.dim, self.base, device=device)

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
        return angles.cos(), angles.sin()
