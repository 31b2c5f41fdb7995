"""LayerNorm and RMSNorm, both computed in fp32 whatever the parameter dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.transformer_config import TransformerConfig


def _scale(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """The fp32 scale a norm multiplies by: weight, or 1 + weight with --apply-layernorm-1p."""
    return weight.float() + 1.0 if zero_centered else weight.float()


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, in fp32.

    zero_centered (--apply-layernorm-1p): the weight starts at 0 and the scale is 1 + weight."""

    def __init__(
        self, hidden_size: int, *, eps: float, dtype: torch.dtype, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        initial = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(initial(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = _scale(self.weight, self.zero_centered)
        out = F.layer_norm(x.float(), (x.shape[-1],), scale, self.bias.float(), self.eps)
        return out.to(x.dtype)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32 (no mean, no bias).

    zero_centered (--apply-layernorm-1p): the weight starts at 0 and the scale is 1 + weight."""

    def __init__(
        self, hidden_size: int, *, eps: float, dtype: torch.dtype, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        initial = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(initial(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        inv_rms = torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x_fp32 * inv_rms * _scale(self.weight, self.zero_centered)).to(x.dtype)


def build_norm(config: TransformerConfig, size: int | None = None) -> nn.Module:
    """The norm chosen by `config.normalization` over the last `size` channels (default
    hidden_size: the pre-norms; --qk-layernorm passes a head or latent width)."""
    kind = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}.get(config.normalization)
    if kind is not None:
        return kind(
            config.hidden_size if size is None else size,
            eps=config.layernorm_epsilon,
            dtype=config.params_dtype,
            zero_centered=config.apply_layernorm_1p,
        )
    raise ValueError(
        f"normalization={config.normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'"
    )
