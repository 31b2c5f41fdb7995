"""Shared pieces of the MoE tests: a tiny MoE config, seeded parameter values, and a plain
loop-over-tokens reference of the MoE layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN = 16
EXPERTS = 4


def moe_config(**overrides: Any) -> TransformerConfig:
    """One MoE layer of hidden 16, 4 experts of width 8, top-2 softmax, fp32, no dropout."""
    fields: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        vocab_size=64,
        max_sequence_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


@torch.no_grad()
def fill_parameters(module: torch.nn.Module, seed: int) -> None:
    """normal(0, 0.3) values from `seed`, in named_parameters order (large enough that the
    router's choices are far from ties)."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in module.named_parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def reference_topk(logits_row: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest entries, by sorting a Python list."""
    ranked = sorted(range(len(logits_row)), key=lambda index: -float(logits_row[index].detach()))
    return ranked[:k]


def reference_expert(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, *, swiglu: bool
) -> torch.Tensor:
    hidden = x @ fc1.t()
    if swiglu:
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    return hidden @ fc2.t()


def reference_moe(x_TD: torch.Tensor, params: dict[str, torch.Tensor], config) -> torch.Tensor:
    """Softmax top-k MoE token by token: sum_e p_e expert_e(x) (+ gated shared experts)."""
    outputs = []
    for token in x_TD:
        logits = params["router.weight"] @ token
        chosen = reference_topk(logits, config.moe_router_topk)
        weights = torch.exp(logits[chosen]) / torch.exp(logits[chosen]).sum()
        out = torch.zeros_like(token)
        for weight, expert in zip(weights, chosen, strict=True):
            fc1 = params["experts.linear_fc1.weight"][expert]
            fc2 = params["experts.linear_fc2.weight"][expert]
            out = out + weight * reference_expert(token, fc1, fc2, swiglu=config.swiglu)
        if "shared_experts.linear_fc1.weight" in params:
            shared = reference_expert(
                token,
                params["shared_experts.linear_fc1.weight"],
                params["shared_experts.linear_fc2.weight"],
                swiglu=config.swiglu,
            )
            if "shared_experts.linear_gate.weight" in params:
                shared = shared * torch.sigmoid(params["shared_experts.linear_gate.weight"] @ token)
            out = out + shared
        outputs.append(out)
    return torch.stack(outputs)
