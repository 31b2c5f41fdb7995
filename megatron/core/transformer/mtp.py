"""Multi-token prediction (DeepSeek-V3, Megatron-LM's MultiTokenPredictionBlock).

Depth k = 1..mtp_num_layers, with h_0 the decoder's output after its final norm (as in
megatron-core 0.16: with MTP, TransformerBlock applies final_layernorm in the stage holding the
last decoder layer, and the MTP layer's hnorm reads that output):
    e_k = embedding(input_ids rolled left by k)             (the model's own embedding)
    h_k = final_layernorm(transformer_layer(eh_proj([enorm(e_k) | hnorm(h_{k-1})])))
    loss_k = sum(mask_k * CE(output_layer(h_k), labels_k)) / max(sum(mask_k), 1)
where labels_k and mask_k are the labels and loss mask rolled left by k (zero filled: the
last k positions have no target). The output layer is the model's (tied or not). The losses
are not added to the language-model loss: attach_aux_loss sends
mtp_loss_scaling_factor / mtp_num_layers * loss_k into backward through the main hidden
states, and MTPMetrics records loss_k for the log line as Megatron-LM names it ("mtp_k loss").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.attention import RotaryCosSin
from megatron.core.transformer.linear import build_linear
from megatron.core.transformer.moe.metrics import MoEMetrics, attach_aux_loss, scale_on_device
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def mtp_config_problem(c: Any) -> str | None:
    """One line naming the flags and the fix when the multi-token prediction settings cannot
    work, else None (`c`: a TransformerConfig or the parsed flags)."""
    depths = c.mtp_num_layers
    if depths is None or depths == 0:  # 0 is off, as in Megatron-LM
        return None
    if depths < 0:
        return f"--mtp-num-layers {depths} must be >= 1; omit it for next-token prediction only."
    scale = c.mtp_loss_scaling_factor
    if not (math.isfinite(scale) and scale >= 0):
        return f"--mtp-loss-scaling-factor {scale} must be a finite number >= 0 (default 0.1)."
    return None


def mtp_depths(config: TransformerConfig) -> int:
    """Number of MTP layers the model builds (None and 0 build none)."""
    return config.mtp_num_layers or 0


def mtp_loss_name(depth: int) -> str:
    """Megatron-LM's log name of depth `depth`'s loss (1-based)."""
    return f"mtp_{depth} loss"


def roll_left(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, S] -> each row moved `shift` positions left, the last `shift` set to zero."""
    rolled = torch.zeros_like(tensor)
    rolled[:, : tensor.shape[1] - shift] = tensor[:, shift:]
    return rolled


class MTPMetrics:
    """Each depth's loss, summed over the forwards since `reset`, and the backward scale of
    the MTP losses (the factor the training loop multiplies its main loss by before
    backward, as MoEMetrics.backward_scale)."""

    def __init__(self, depths: int) -> None:
        # On the host until the training loop names its device: see `scale_on_device`.
        self.backward_scale = torch.ones((), device="cpu")
        self.depths = depths
        self.reset()

    def set_backward_scale(self, scale: float, device: torch.device | None = None) -> None:
        self.backward_scale = scale_on_device(self.backward_scale, scale, device)

    def reset(self) -> None:
        self._sums: list[torch.Tensor | None] = [None] * self.depths
        self._count = 0

    def record(self, losses: list[torch.Tensor]) -> None:
        for index, loss in enumerate(losses):
            value = loss.detach().float()
            previous = self._sums[index]
            self._sums[index] = value if previous is None else previous + value
        self._count += 1

    def report(self) -> dict[str, float]:
        """{"mtp_1 loss": mean over the recorded forwards, ...}; empty before any."""
        if self._count == 0:
            return {}
        return {
            mtp_loss_name(index + 1): float(total) / self._count
            for index, total in enumerate(self._sums)
        }


class MultiTokenPredictionLayer(nn.Module):
    """enorm, hnorm, eh_proj (2 x hidden -> hidden, no bias), transformer_layer and
    final_layernorm of one depth. Its transformer layer is built as the decoder's last layer
    (layer_number num_layers): dense or MoE and FP8 or not as that layer. An MoE router's
    records go under layer num_layers + depth, as Megatron-LM's MTP routers' (not mixed into
    the decoder's last layer)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        depth: int = 1,
        expert_parallel_group: dist.ProcessGroup | None = None,
        moe_metrics: MoEMetrics | None = None,
    ) -> None:
        super().__init__()
        last = config.num_layers
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = build_linear(
            2 * config.hidden_size, config.hidden_size, bias=False, config=config, layer_number=last
        )
        self.transformer_layer = TransformerLayer(
            config,
            layer_number=last,
            expert_parallel_group=expert_parallel_group,
            moe_metrics=moe_metrics,
        )
        router = getattr(self.transformer_layer.mlp, "router", None)
        if router is not None:
            router.layer_number = last + depth
        self.final_layernorm = build_norm(config)

    def forward(
        self, hidden_BSD: torch.Tensor, embedded_BSD: torch.Tensor, rotary_cos_sin: RotaryCosSin
    ) -> torch.Tensor:
        joined = torch.cat((self.enorm(embedded_BSD), self.hnorm(hidden_BSD)), dim=-1)
        return self.final_layernorm(self.transformer_layer(self.eh_proj(joined), rotary_cos_sin))


class MultiTokenPrediction(nn.Module):
    """`layers` (one MultiTokenPredictionLayer per depth) and `metrics` (MTPMetrics)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        expert_parallel_group: dist.ProcessGroup | None = None,
        moe_metrics: MoEMetrics | None = None,
    ) -> None:
        super().__init__()
        self.loss_scale = config.mtp_loss_scaling_factor / mtp_depths(config)
        self.metrics = MTPMetrics(mtp_depths(config))
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(
                config,
                depth=depth,
                expert_parallel_group=expert_parallel_group,
                moe_metrics=moe_metrics,
            )
            for depth in range(1, mtp_depths(config) + 1)
        )

    def forward(
        self,
        hidden_BSD: torch.Tensor,
        *,
        embed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor],
        cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        batch: dict[str, torch.Tensor],
        rotary_cos_sin: RotaryCosSin,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`hidden_BSD` (the decoder's output) with the MTP losses attached for backward, and
        the losses. `batch`: input_ids, position_ids, labels, loss_mask ([B, S] each);
        `cross_entropy`: logits and labels -> the per-token loss [B, S] (the model's)."""
        losses, depth_hidden = [], hidden_BSD
        for depth, layer in enumerate(self.layers, start=1):
            embedded = embed(
                roll_left(batch["input_ids"], depth), roll_left(batch["position_ids"], depth)
            )
            depth_hidden = layer(depth_hidden, embedded, rotary_cos_sin)
            mask = roll_left(batch["loss_mask"], depth).float()
            token_losses = cross_entropy(logits(depth_hidden), roll_left(batch["labels"], depth))
            losses.append((token_losses * mask).sum() / mask.sum().clamp(min=1.0))
        if self.training and torch.is_grad_enabled():
            self.metrics.record(losses)
        total = torch.stack(losses).sum() * self.loss_scale
        return attach_aux_loss(hidden_BSD, total, self.metrics), losses


def find_mtp(model: nn.Module) -> MultiTokenPrediction | None:
    """The MultiTokenPrediction inside `model` (any wrapper), or None."""
    return next((m for m in model.modules() if isinstance(m, MultiTokenPrediction)), None)
