"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

Selective recompute of `mlp` (a dense layer) or `moe` (an MoE layer) runs the MLP under
activation checkpoint (config.recompute_modules)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.tensor_parallel import TensorParallel
from megatron.core.transformer.attention import RotaryCosSin
from megatron.core.transformer.mla import build_self_attention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.config_checks import moe_layer_pattern
from megatron.core.transformer.moe.metrics import MoEMetrics
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.recompute import recompute_or_run, recomputes
from megatron.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """Holds every parameter of one layer, so it can be one FSDP unit.

    `layer_number` is 1-based (it decides FP8 for the first/last-layers-in-bf16 option).
    `mlp` is an MoELayer where --moe-layer-freq makes this layer MoE; its experts are split
    over `expert_parallel_group` and its router losses go to `moe_metrics`. `tensor_parallel`
    splits attention heads and the MLP's width over its group.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        layer_number: int,
        expert_parallel_group: dist.ProcessGroup | None = None,
        moe_metrics: MoEMetrics | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = build_self_attention(
            config, layer_number=layer_number, tensor_parallel=tensor_parallel
        )
        self.pre_mlp_layernorm = build_norm(config)
        if moe_layer_pattern(config)[layer_number - 1]:
            self.mlp = MoELayer(
                config,
                layer_number=layer_number,
                expert_parallel_group=expert_parallel_group,
                metrics=moe_metrics,
            )
        else:
            self.mlp = MLP(config, layer_number=layer_number, tensor_parallel=tensor_parallel)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.recompute_mlp = recomputes(config, "moe" if isinstance(self.mlp, MoELayer) else "mlp")

    def forward(self, x_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin = None) -> torch.Tensor:
        attention_out = self.self_attention(self.input_layernorm(x_BSD), rotary_cos_sin)
        x_BSD = x_BSD + self.hidden_dropout(attention_out)
        mlp_out = recompute_or_run(self.recompute_mlp, self.mlp, self.pre_mlp_layernorm(x_BSD))
        return x_BSD + self.hidden_dropout(mlp_out)
