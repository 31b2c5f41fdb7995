"""Multi-token prediction in the training step (--mtp-num-layers): the backward scale of the
MTP losses, set before each micro-batch's forward, and the step's MTP losses for the log."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.transformer.mtp import find_mtp


def prepare_mtp(
    model: nn.Module,
    mask: torch.Tensor,
    num_microbatches: int,
    loss_scale: float,
    tokens_per_rank: float | None,
) -> dict[str, torch.Tensor]:
    """With --mtp-num-layers: set the MTP losses' backward scale to the factor backward sees
    the main loss's token mean times (before the forward, which saves it), and return the
    loss mask the MTP losses use as a forward keyword; else {}."""
    mtp = find_mtp(model)
    if mtp is None:
        return {}
    if tokens_per_rank is not None:
        scale = float(mask.sum()) / tokens_per_rank
    else:
        scale = 1.0 / num_microbatches
    mtp.metrics.set_backward_scale(scale * loss_scale, mask.device)
    return {"loss_mask": mask}


def step_mtp_losses(model: nn.Module) -> dict[str, float]:
    """This rank's MTP losses of the step (mean over its micro-batches) by their Megatron-LM
    names; the metrics restart for the next step."""
    mtp = find_mtp(model)
    if mtp is None:
        return {}
    report = mtp.metrics.report()
    mtp.metrics.reset()
    return report
