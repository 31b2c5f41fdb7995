"""Optimizer settings, one dataclass built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam(W) or SGD over fp32 main params, with global grad-norm clipping."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """`adam` is AdamW (decoupled weight decay), as in Megatron-LM (`--optimizer`)."""

    lr: float = 1e-4
    """Peak learning rate (`--lr`)."""

    min_lr: float = 0.0
    """Floor the schedule decays to (`--min-lr`)."""

    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and norm weights (`--weight-decay`)."""

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8

    sgd_momentum: float = 0.9
    """Momentum of SGD (`--sgd-momentum`)."""

    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and output layer weights (`--decoupled-lr`);
    None: they follow `lr` like every other parameter."""

    decoupled_min_lr: float | None = None
    """Floor of the decoupled learning rate (`--decoupled-min-lr`; None: `min_lr`)."""

    mup_width_mult: float = 1.0
    """muP width mult (hidden / base hidden, `--use-mup`): hidden matrices train at lr / m and
    eps / m (optimizer.is_mup_scaled_parameter); 1.0 is the standard parametrization."""

    clip_grad: float = 1.0
    """Clip the global L2 grad norm (over all shards and ranks) to this value; 0 disables."""

    use_precision_aware_optimizer: bool = False
    """Moments in `exp_avg_dtype`/`exp_avg_sq_dtype` (`--use-precision-aware-optimizer`); without
    it both stay fp32, as in Megatron-LM."""

    exp_avg_dtype: str = "fp32"
    """AdamW first moment: fp32, bf16, fp16 or fp8 (`--exp-avg-dtype`)."""

    exp_avg_sq_dtype: str = "fp32"
    """AdamW second moment: fp32, bf16, fp16 or fp8 (`--exp-avg-sq-dtype`)."""

    moment_scaling: str | None = "tensor"
    """Scale rule of fp16/fp8 moments: "tensor" (TransformerEngine's, one fp32 scale per
    tensor) or "block" (one per 128 elements); None refuses scaled moments."""

    optimizer_cpu_offload: bool = False
    """Keep `optimizer_offload_fraction` of the AdamW state and update on the CPU
    (`--optimizer-cpu-offload`)."""

    optimizer_offload_fraction: float = 1.0
    """Fraction of the optimizer's elements offloaded (`--optimizer-offload-fraction`)."""
