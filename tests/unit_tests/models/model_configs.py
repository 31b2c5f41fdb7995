"""Tiny model configs shared by the model tests."""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB = 64
SEQ = 8


def tiny_config(**overrides: Any) -> TransformerConfig:
    """2 layers, hidden 32, 4 heads, dropout off, fp32."""
    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_sequence_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def token_batch(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=generator)
