"""Megatron's log lines. Their fields are a public interface (tools parse them): change them only
together with test_log_line_fields in tests/unit_tests/training/test_training.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class IntervalStats:
    """Numbers accumulated between two log lines, as Megatron-LM counts them: the loss is the
    mean over the iterations that updated the weights, and the skipped and NaN counters start
    from 0 at every log line (a NaN iteration is a skipped one whose loss is NaN or Inf)."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    last_grad_norm: float = float("nan")
    skipped: int = 0
    nans: int = 0
    extra_losses: dict[str, list[float]] = field(default_factory=dict)
    """Losses logged after the lm loss under their Megatron-LM names ("mtp_1 loss", ...)."""

    def add(
        self,
        *,
        loss: float,
        grad_norm: float,
        seconds: float,
        skipped: bool,
        extra_losses: dict[str, float] | None = None,
    ) -> None:
        if skipped:
            self.skipped += 1
            self.nans += int(not math.isfinite(loss))
        else:
            self.losses.append(loss)
            for name, value in (extra_losses or {}).items():
                self.extra_losses.setdefault(name, []).append(value)
        self.seconds.append(seconds)
        self.last_grad_norm = grad_norm

    def mean_loss(self) -> float:
        """NaN when every iteration of the interval was skipped."""
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def mean_extra_losses(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.extra_losses.items()}

    def mean_seconds(self) -> float:
        return sum(self.seconds) / len(self.seconds)


def format_train_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    iteration_ms: float,
    tflops_per_gpu: float,
    tokens_per_gpu: float,
    learning_rate: float,
    global_batch_size: int,
    loss: float,
    grad_norm: float,
    skipped: int,
    nans: int,
    mem_gib: float,
    loss_scale: float | None = None,
    num_zeros: int | None = None,
    params_norm: float | None = None,
    extra_losses: dict[str, float] | None = None,
    extra_fields: dict[str, float] | None = None,
) -> str:
    """Megatron-LM's iteration line (core_v0.19.0's training_log, plus tokens per GPU and
    memory). loss scale (1.0 without a grad scaler, as Megatron-LM prints it), num zeros
    (--log-num-zeros-in-grad) and params norm (--log-params-norm) where Megatron-LM puts them;
    after lm loss, as in its total_loss_dict, the `extra_fields` whose names end in "loss"
    (MoE: load_balancing_loss, z_loss, ...), then `extra_losses` ("mtp_1 loss" with
    --mtp-num-layers); the other `extra_fields` (dropped_token_fraction) before loss scale,
    where Megatron-LM's MoE log string goes."""
    fields = extra_fields or {}
    losses = {**{k: v for k, v in fields.items() if k.endswith("loss")}, **(extra_losses or {})}
    ordered = {**losses, **fields}  # the other fields after the losses
    extras = "".join(f" {name}: {value:.6E} |" for name, value in ordered.items())
    scale = 1.0 if loss_scale is None else loss_scale
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {iteration_ms:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.3f} |"
        f" tokens per GPU (tokens/s/GPU): {tokens_per_gpu:.1f} |"
        f" learning rate: {learning_rate:.6E} |"
        f" global batch size: {global_batch_size:5d} |"
        f" lm loss: {loss:.6E} |"
        + extras
        + f" loss scale: {scale:.1f} |"
        + f" grad norm: {grad_norm:.3f} |"
        + (f" num zeros: {num_zeros} |" if num_zeros is not None else "")
        + (f" params norm: {params_norm:.3f} |" if params_norm is not None else "")
        + f" number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nans:3d} |"
        f" mem allocated (GiB): {mem_gib:.2f} |"
    )


def format_valid_line(iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return (
        f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
        f" lm loss PPL: {ppl:.6E} |"
    )
