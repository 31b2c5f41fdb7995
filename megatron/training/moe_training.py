"""What the training loop does for MoE models, as Megatron-LM does it.

- the router's aux losses (load balancing, z-loss) back-propagate with the scale of the main
  loss of one micro-batch: loss scale / micro-batches; with per-token loss, loss scale times
  the micro-batch's routed tokens over the rank's share of the global batch's loss tokens
  (Megatron-LM's num_local_tokens / total tokens: 1 / micro-batches when no token is masked);
- after the grads of a step are reduced, the aux-loss-free expert bias of every router moves
  by its update rate against the token counts summed over every data-parallel rank;
- the log line gets Megatron-LM's names (load_balancing_loss, seq_load_balancing_loss,
  z_loss) averaged over the interval's micro-batches, the MoE layers and the data-parallel
  ranks, plus dropped_token_fraction when a capacity factor is set; TensorBoard/W&B also get
  each layer's expert load (fraction of routed tokens per expert), and with
  --moe-per-layer-logging each MoE layer's router losses (moe/<name>_layer_<i>).
A dense model (no MoEMetrics) makes every function here a no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.metrics import (
    LOAD_BALANCING_LOSS,
    SEQ_LOAD_BALANCING_LOSS,
    Z_LOSS,
    MoEMetrics,
)
from megatron.core.transformer.moe.router import update_expert_biases
from megatron.training.initialize import DistributedEnv
from megatron.training.model_setup import ModelAndOptimizer


def moe_metrics(run: ModelAndOptimizer) -> MoEMetrics | None:
    return run.module.decoder.moe_metrics


def set_aux_loss_scale(
    run: ModelAndOptimizer,
    *,
    loss_scale: float,
    num_microbatches: int,
    tokens_per_rank: float | None,
    microbatch_tokens: int,
    device: torch.device,
) -> None:
    """The factor each micro-batch's aux losses are multiplied by before backward, on the
    training device (where backward reads it). tokens_per_rank: with per-token loss, the
    global batch's loss tokens per data-parallel rank (else None); microbatch_tokens: the
    tokens one micro-batch routes."""
    metrics = moe_metrics(run)
    if metrics is not None:
        if tokens_per_rank is None:
            scale = loss_scale / num_microbatches
        else:
            scale = loss_scale * microbatch_tokens / tokens_per_rank
        metrics.set_backward_scale(scale, device)


def after_grad_sync(run: ModelAndOptimizer, env: DistributedEnv) -> None:
    """The expert-bias step of every router (Megatron-LM: when finalizing the grads)."""
    if moe_metrics(run) is not None and run.config.moe_router_enable_expert_bias:
        update_expert_biases(run.module, group=env.dp_group)


def _mean_over_dp(values: list[float], env: DistributedEnv) -> list[float]:
    if env.dp_group is None or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, group=env.dp_group)
    return (tensor / env.data_parallel_size).tolist()


def _always_logged(config) -> list[str]:
    """The router losses Megatron-LM's log line shows even where none was recorded (as 0):
    its training_log tracks load_balancing_loss when "aux_loss" is in the balancing type's
    text (seq_aux_loss too), seq_load_balancing_loss for seq_aux_loss, and z_loss when a
    z-loss coefficient is given."""
    kind = config.moe_router_load_balancing_type
    names = [LOAD_BALANCING_LOSS] if "aux_loss" in kind else []
    names += [SEQ_LOAD_BALANCING_LOSS] if kind == "seq_aux_loss" else []
    return names + ([Z_LOSS] if config.moe_z_loss_coeff is not None else [])


def interval_moe_fields(
    run: ModelAndOptimizer, env: DistributedEnv, *, per_layer: bool = False
) -> tuple[dict[str, float], dict[str, float]]:
    """The interval's MoE log fields, and with per_layer (--moe-per-layer-logging) each MoE
    layer's values as Megatron-LM names them for TensorBoard/W&B, `moe/<name>_layer_<i>`
    (i: the 0-based layer index), both averaged over the DP ranks in one collective (every
    rank calls it at each log line)."""
    metrics = moe_metrics(run)
    if metrics is None:
        return {}, {}
    report = {**{name: 0.0 for name in _always_logged(run.config)}, **metrics.report()}
    scalars = dict(report)
    for name in report if per_layer else ():
        for layer, value in metrics.per_layer(name).items():
            scalars[f"moe/{name}_layer_{layer - 1}"] = value
    means = dict(zip(scalars, _mean_over_dp(list(scalars.values()), env)))
    fields = {name: means.pop(name) for name in report}
    return fields, means


def expert_load_scalars(run: ModelAndOptimizer, env: DistributedEnv) -> dict[str, float]:
    """Per layer and expert: its share of the interval's routed tokens over all DP ranks,
    as `moe/layer_{L}/expert_{E}_load` (a collective over the DP ranks); then restarts the
    metrics."""
    metrics = moe_metrics(run)
    if metrics is None:
        return {}
    scalars = {}
    layers = sorted(metrics.tokens_per_expert)
    if layers:  # every layer in one all-reduce and one copy to the host (not one per layer)
        counts = torch.stack([metrics.tokens_per_expert[layer] for layer in layers])
        counts = counts.to(env.device, torch.float64)
        if env.dp_group is not None:
            dist.all_reduce(counts, group=env.dp_group)
        shares = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)).tolist()
        for layer, row in zip(layers, shares, strict=True):
            for expert, share in enumerate(row):
                scalars[f"moe/layer_{layer}/expert_{expert}_load"] = share
    metrics.reset()
    return scalars
