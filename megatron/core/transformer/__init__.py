"""Transformer building blocks: config, layer, block, attention, MLP, norms, rope, init.

The model built from them, GPTModel, lives in megatron.core.models.gpt (which imports this
package, so this package does not name it)."""

from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.linear import build_linear
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "build_linear",
    "init_parameter_",
]
