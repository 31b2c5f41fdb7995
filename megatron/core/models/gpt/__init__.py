"""The GPT model: plain nn.Modules, no parallelism or FP8 logic inside."""

from megatron.core.models.gpt.flops import (
    count_parameters,
    count_parameters_from_config,
    num_floating_point_operations,
)
from megatron.core.models.gpt.gpt_model import GPTModel, check_model_config
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "GPTModel",
    "TransformerLayer",
    "check_model_config",
    "count_parameters",
    "count_parameters_from_config",
    "num_floating_point_operations",
]
