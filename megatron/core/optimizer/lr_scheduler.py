"""Learning-rate schedules by iteration: constant, linear, cosine and WSD, with linear warmup."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from megatron.core.optimizer.optimizer import MegatronOptimizer


@dataclass(kw_only=True)
class LRScheduleConfig:
    max_lr: float
    min_lr: float = 0.0
    warmup_iters: float = 0
    """Linear warmup length; fractional with --lr-warmup-fraction (fraction x decay_iters)."""
    warmup_init: float = 0.0
    """Learning rate the warmup starts from (`--lr-warmup-init`)."""
    decay_iters: int
    """Iteration at which the decay reaches min_lr (`--lr-decay-iters`, default --train-iters)."""
    decay_style: Literal["constant", "linear", "cosine", "WSD"] = "linear"
    wsd_decay_iters: int = 0
    """WSD: length of the final annealing phase (`--lr-wsd-decay-iters`)."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"


def learning_rate_at(iteration: int, config: LRScheduleConfig) -> float:
    """The schedule's lr after `iteration` updates (update k runs at learning_rate_at(k - 1))."""
    if config.warmup_iters > 0 and iteration <= config.warmup_iters:
        return config.warmup_init + (config.max_lr - config.warmup_init) * (
            iteration / config.warmup_iters
        )
    if config.decay_style == "constant":
        return config.max_lr
    if iteration > config.decay_iters:
        return config.min_lr
    delta_lr = config.max_lr - config.min_lr
    if config.decay_style == "WSD":
        anneal_start = config.decay_iters - config.wsd_decay_iters
        if iteration <= anneal_start:
            return config.max_lr
        if config.wsd_decay_iters <= 0:
            return config.min_lr
        # Not max(1, ...): with --lr-wsd-decay-samples the phase can be under one iteration.
        ratio = (iteration - anneal_start) / config.wsd_decay_iters
        coeff = {
            "linear": 1.0 - ratio,
            "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0),
            "exponential": 2.0 * 0.5**ratio - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(ratio),
        }[config.wsd_decay_style]
        return config.min_lr + coeff * delta_lr
    decay_span = config.decay_iters - config.warmup_iters
    ratio = (iteration - config.warmup_iters) / decay_span if decay_span > 0 else 1.0
    if config.decay_style == "linear":
        coeff = 1.0 - ratio
    else:  # cosine
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return config.min_lr + coeff * delta_lr


class OptimizerParamScheduler:
    """Sets each param group's lr before every step; its state is the number of updates done.

    As megatron-core's scheduler, stepped after the optimizer: update k (1-based) uses
    learning_rate_at(k - 1), so with warmup from --lr-warmup-init 0 the first update is at lr
    0, and the lr read after update k (the log line's) is learning_rate_at(k)
    (tests/unit_tests/ecosystem/test_mcore_lr_schedule.py).
    """

    def __init__(self, optimizer: MegatronOptimizer, *, config: LRScheduleConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.num_steps = 0
        self.step(0)

    def step(self, increment: int = 1) -> float:
        """Count `increment` finished updates and set the lr of the next one: the schedule's
        value at the count of updates done."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            config = self.config
            if "max_lr" in group:  # --decoupled-lr: this group's own peak and floor
                config = dataclasses.replace(config, max_lr=group["max_lr"], min_lr=group["min_lr"])
            group["lr"] = learning_rate_at(self.num_steps, config)
        return self.get_lr()

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "config": dataclasses.asdict(self.config)}

    def load_state_dict(self, state: dict, *, use_saved_config: bool = False) -> None:
        """Restore the step count; with use_saved_config also the saved schedule."""
        self.num_steps = int(state["num_steps"])
        if use_saved_config and "config" in state:
            self.config = LRScheduleConfig(**state["config"])
        self.step(0)

    def config_differences(self, state: dict) -> list[tuple[str, object, object]]:
        """(field, saved, current) for each schedule field that differs from `state`'s (none
        for a state saved before the schedule was recorded)."""
        saved = state.get("config")
        if saved is None:
            return []
        current = dataclasses.asdict(self.config)
        # A field added after a checkpoint was written counts as its default there.
        defaults = {f.name: f.default for f in dataclasses.fields(LRScheduleConfig)}
        return [
            (k, saved.get(k, defaults[k]), v)
            for k, v in current.items()
            if not _same_setting(saved.get(k, defaults[k]), v)
        ]


def _same_setting(saved, current) -> bool:
    """Equal, or for numbers equal up to rounding: a warmup of 7 iterations written as
    --lr-warmup-fraction 0.07 of 100 is 7.000000000000001."""
    numbers = (int, float)
    if isinstance(saved, numbers) and isinstance(current, numbers):
        if isinstance(saved, bool) or isinstance(current, bool):
            return saved == current
        return math.isclose(saved, current, rel_tol=1e-9, abs_tol=1e-12)
    return saved == current
