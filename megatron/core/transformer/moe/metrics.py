"""How the router's losses reach the gradients and the log.

The load-balancing losses and the z-loss are not added to the language-model loss. As in
Megatron-LM, each is attached to a tensor of the forward pass by `attach_aux_loss`, an identity
whose backward also sends d(aux)/d(aux) = `backward_scale` into the aux loss' graph, so
backward of the main loss alone fills both gradients. The training loop sets
`MoEMetrics.backward_scale` before backward (megatron/training/moe_training.py:
1 / micro-batches times any loss scale, or with per-token loss the micro-batch's share of
the global batch's loss tokens).
"""

from __future__ import annotations

from collections import defaultdict

import torch

# Megatron-LM's names of the values a router records (and logs).
LOAD_BALANCING_LOSS = "load_balancing_loss"
SEQ_LOAD_BALANCING_LOSS = "seq_load_balancing_loss"
Z_LOSS = "z_loss"
# Not a Megatron-LM name: the fraction of (token, expert) choices dropped past capacity.
DROPPED_TOKEN_FRACTION = "dropped_token_fraction"


def scale_on_device(
    current: torch.Tensor, scale: float, device: torch.device | None
) -> torch.Tensor:
    """`current` (a 0-dim fp32 tensor) filled with `scale`, replaced first by one on `device`
    when it lies elsewhere. A backward scale must lie where backward reads it: a host tensor
    there is a host-to-device copy of pageable memory, which synchronizes the stream, once per
    MoE layer and micro-batch (inside the compiled layers too), draining the GPU's queue."""
    target = current.device if device is None else torch.device(device)
    if current.device.type != target.type or target.index not in (None, current.device.index):
        current = torch.empty((), dtype=torch.float32, device=target)
    return current.fill_(scale)


class MoEMetrics:
    """Per-layer router losses (recorded divided by their coefficient, as Megatron-LM logs
    them) and per-expert token counts, summed over the forwards since the last `reset`, plus
    the backward scale of the aux losses. One object is shared by all MoE layers of a model;
    no global state."""

    def __init__(self) -> None:
        # On the host until the training loop names its device (a meta-device build's
        # included): see `scale_on_device`.
        self.backward_scale = torch.ones((), device="cpu")
        self._sums: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self._counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.tokens_per_expert: dict[int, torch.Tensor] = {}

    def set_backward_scale(self, scale: float, device: torch.device | None = None) -> None:
        """The factor the aux losses' gradient is multiplied by, kept on `device`."""
        self.backward_scale = scale_on_device(self.backward_scale, scale, device)

    def record(self, name: str, value: torch.Tensor, *, layer_number: int) -> None:
        value = value.detach().float()
        sums = self._sums[name]
        sums[layer_number] = sums[layer_number] + value if layer_number in sums else value
        self._counts[name][layer_number] += 1

    def record_tokens(self, counts: torch.Tensor, *, layer_number: int) -> None:
        """Tokens routed to each expert (after capacity) in one forward of layer_number."""
        counts = counts.detach().float()
        previous = self.tokens_per_expert.get(layer_number)
        self.tokens_per_expert[layer_number] = counts if previous is None else previous + counts

    def per_layer(self, name: str) -> dict[int, float]:
        """Mean of `name` over the recorded forwards, per layer number."""
        return {
            layer: float(total) / self._counts[name][layer]
            for layer, total in sorted(self._sums[name].items())
        }

    def report(self) -> dict[str, float]:
        """Each recorded name averaged over the forwards (micro-batches) and then over the MoE
        layers, as Megatron-LM's log line."""
        report = {}
        for name in sorted(self._sums):
            values = self.per_layer(name).values()
            report[name] = sum(values) / len(values)
        return report

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
        self.tokens_per_expert.clear()


class _AuxLossIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(loss, scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(loss) * scale.to(loss), None


def attach_aux_loss(
    output: torch.Tensor, loss: torch.Tensor, metrics: MoEMetrics | None
) -> torch.Tensor:
    """`output` unchanged; its backward also back-propagates `loss` with gradient
    metrics.backward_scale (1 without metrics)."""
    scale = metrics.backward_scale if metrics is not None else torch.ones(())
    return _AuxLossIdentity.apply(output, loss, scale)
