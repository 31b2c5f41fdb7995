"""Feed-forward block: GeLU (exact erf) or SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import TensorParallel
from megatron.core.transformer.linear import build_linear, linear_of_activation
from megatron.core.transformer.transformer_config import TransformerConfig


class MLP(nn.Module):
    """fc2(act(fc1(x))).

    With SwiGLU, `linear_fc1` produces [gate | up] (each ffn_hidden_size wide, gate first) and
    act is silu(gate) * up; an exporter splits fc1's weight rows in half to get Llama's
    gate_proj and up_proj. With `tensor_parallel`, fc1 is column-parallel (rank r holds
    [gate_r | up_r]) and fc2 row-parallel.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        layer_number: int,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_blocks = [config.ffn_hidden_size] * (2 if config.swiglu else 1)
        self.linear_fc1 = build_linear(
            config.hidden_size,
            sum(fc1_blocks),
            bias=config.add_bias_linear,
            config=config,
            layer_number=layer_number,
            parallel="column",
            tensor_parallel=tensor_parallel,
            output_blocks=fc1_blocks,
        )
        self.linear_fc2 = build_linear(
            config.ffn_hidden_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            config=config,
            layer_number=layer_number,
            parallel="row",
            tensor_parallel=tensor_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = swiglu if self.swiglu else gelu
        return linear_of_activation(self.linear_fc2, self.linear_fc1(x), activation)


def swiglu(hidden: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fc1's output [gate | up]."""
    gate, up = hidden.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu(hidden: torch.Tensor) -> torch.Tensor:
    """GeLU with the exact erf, as Megatron-LM's default."""
    return F.gelu(hidden, approximate="none")
