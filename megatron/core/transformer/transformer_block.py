"""The decoder stack: transformer layers, full-layer activation recompute, final norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.core.tensor_parallel import TensorParallel
from megatron.core.transformer.attention import RotaryCosSin
from megatron.core.transformer.moe.config_checks import check_moe_config
from megatron.core.transformer.moe.metrics import MoEMetrics
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


class TransformerBlock(nn.Module):
    """`layers` (nn.ModuleList of TransformerLayer) followed by `final_norm`.

    With --num-experts, `moe_metrics` collects the router losses and expert loads of all MoE
    layers (None for a dense model) and `expert_parallel_group` splits their experts."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        expert_parallel_group: dist.ProcessGroup | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        check_moe_config(config)
        self.moe_metrics = MoEMetrics() if config.num_moe_experts is not None else None
        self.full_recompute = config.recompute_granularity == "full"
        self.recompute_num_layers = config.recompute_num_layers
        self.recompute_method = config.recompute_method
        self.layers = nn.ModuleList(
            TransformerLayer(
                config,
                layer_number=number,
                expert_parallel_group=expert_parallel_group,
                moe_metrics=self.moe_metrics,
                tensor_parallel=tensor_parallel,
            )
            for number in range(1, config.num_layers + 1)
        )
        self.final_norm = build_norm(config)

    def _run_layers(
        self, start: int, end: int, x_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin
    ) -> torch.Tensor:
        for layer in self.layers[start:end]:
            x_BSD = layer(x_BSD, rotary_cos_sin)
        return x_BSD

    def forward(self, x_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin = None) -> torch.Tensor:
        if self.full_recompute and torch.is_grad_enabled():
            # Keep only each chunk's input; its layers re-run in backward. Checkpoint saves
            # and restores the RNG state, so dropout masks match the first forward.
            chunks = self._recompute_chunks()
            for start, end in chunks:
                x_BSD = checkpoint(
                    self._run_layers, start, end, x_BSD, rotary_cos_sin, use_reentrant=False
                )
            stored_from = chunks[-1][1] if chunks else 0
            x_BSD = self._run_layers(stored_from, len(self.layers), x_BSD, rotary_cos_sin)
        else:
            x_BSD = self._run_layers(0, len(self.layers), x_BSD, rotary_cos_sin)
        return self.final_norm(x_BSD)

    def _recompute_chunks(self) -> list[tuple[int, int]]:
        """[start, end) layer ranges run under checkpoint, in order; layers after the last
        range keep their activations (block method, as Megatron-LM)."""
        num_layers, per_chunk = len(self.layers), self.recompute_num_layers
        if self.recompute_method == "block":
            return [(index, index + 1) for index in range(min(per_chunk, num_layers))]
        return [
            (start, min(start + per_chunk, num_layers)) for start in range(0, num_layers, per_chunk)
        ]
