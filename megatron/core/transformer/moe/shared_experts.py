"""Shared experts: one dense MLP of width --moe-shared-expert-intermediate-size run on every
token, optionally scaled by a learned sigmoid gate (Megatron-LM's moe_shared_expert_gate)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExperts(MLP):
    """The dense MLP (built by build_linear, so FP8 applies as to any MLP) with
    ffn_hidden_size = moe_shared_expert_intermediate_size; `linear_gate` is a [1, hidden] Linear."""

    def __init__(self, config: TransformerConfig, *, layer_number: int) -> None:
        shared_config = dataclasses.replace(
            config, ffn_hidden_size=config.moe_shared_expert_intermediate_size
        )
        super().__init__(shared_config, layer_number=layer_number)
        self.linear_gate = None
        if config.moe_shared_expert_gate:
            self.linear_gate = nn.Linear(
                config.hidden_size, 1, bias=False, dtype=config.params_dtype
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        if self.linear_gate is not None:
            output = output * torch.sigmoid(self.linear_gate(x))
        return output
