"""Transformer building blocks: config, layer, block, attention, MLP, norms, rope, init."""

from typing import Any

from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.linear import build_linear
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "GPTModel",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "build_linear",
    "init_parameter_",
]


def __getattr__(name: str) -> Any:
    # GPTModel lives in megatron.core.models.gpt, which imports this package; resolving it
    # lazily avoids an import cycle.
    if name == "GPTModel":
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
