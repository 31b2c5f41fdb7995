"""LayerNorm and RMSNorm, both computed in fp32 whatever the parameter dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.transformer_config import TransformerConfig


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, in fp32."""

    def __init__(self, hidden_size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )
        return out.to(x.dtype)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32 (no mean, no bias)."""

    def __init__(self, hidden_size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        inv_rms = torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x_fp32 * inv_rms * self.weight.float()).to(x.dtype)


def build_norm(config: TransformerConfig) -> nn.Module:
    """The pre-norm chosen by `config.normalization`."""
    if config.normalization == "LayerNorm":
        return LayerNorm(
            config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype
        )
    if config.normalization == "RMSNorm":
        return RMSNorm(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    raise ValueError(
        f"normalization={config.normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'"
    )
