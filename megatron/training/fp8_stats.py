"""--log-fp8-stats: per Fp8Linear (and routed experts' Fp8StackedLinear, all experts of one
Linear together) and role (input, weight, grad), every --log-fp8-stats-interval
iterations, the amax, the scale and the fractions that saturate and flush to zero when
quantized (megatron.core.fp8.stats), to the log, TensorBoard and W&B (issue 41).

On a statistics iteration every Fp8Linear's `fp8_stats_on` switch is set for the whole step;
each operand's statistics stay on the device as one float64 vector (no sync) and the step's
vectors reach the host in one `.tolist()` after it. Nothing the step computes changes: the
statistics read the operands and write nothing back (tests/unit_tests/training/
test_fp8_stats_logging.py compares the losses bitwise). Compiled layers run eagerly on these
iterations only (set_stance("force_eager"); their graphs are kept): the statistics hand Python
a vector per operand in forward and backward, which a compiled backward cannot. Each operand
costs two chunked reads, each one torch.compile'd kernel per chunk on CUDA (fp8/stats.py).
The numbers are this rank's (its micro-batches): counts summed over the step's micro-batches,
amax the largest, scale the last one used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron.core.fp8.linear import Fp8Linear
from megatron.core.fp8.stats import STATS_FIELDS, Fp8TensorStats, stats_from_vector
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear

ROLES_LOGGED = ("input", "weight", "grad")
WORST_SHOWN = 3
"""Linears named in the log line per fraction (the largest first)."""


class Fp8StatsCollector:
    """The statistics switch of one model's Fp8Linears (and experts') and what one step
    collected."""

    def __init__(self, model: nn.Module, *, interval: int, recipe: str, fp8_format: str) -> None:
        if interval <= 0:
            raise ValueError(f"--log-fp8-stats-interval must be positive, got {interval}")
        self.interval, self.recipe, self.fp8_format = interval, recipe, fp8_format
        self.linears = {
            name.removeprefix("module."): module
            for name, module in model.named_modules()
            if isinstance(module, (Fp8Linear, Fp8StackedLinear))
        }
        self._names = {id(module): name for name, module in self.linears.items()}
        self._records: dict[tuple[str, str], list[tuple[torch.Tensor, int]]] = {}

    def due(self, iteration: int) -> bool:
        """Whether iteration (1-based, the one about to run) collects statistics."""
        return iteration % self.interval == 0

    def switch(self, on: bool) -> None:
        for linear in self.linears.values():
            linear.fp8_stats_sink = self._add if on else None
            linear.fp8_stats_on = on

    def _add(self, module: nn.Module, role: str, vector: torch.Tensor, numel: int) -> None:
        self._records.setdefault((self._names[id(module)], role), []).append((vector, numel))

    def read(self) -> dict[tuple[str, str], Fp8TensorStats]:
        """The collected statistics by (Linear name, role), with one device-to-host copy;
        forgets them."""
        records, self._records = self._records, {}
        if not records:
            return {}
        keys = list(records)
        host = torch.stack([v for key in keys for v, _ in records[key]]).tolist()
        result, at = {}, 0
        for key in keys:
            rows = host[at : at + len(records[key])]
            numel = sum(n for _, n in records[key])
            at += len(rows)
            result[key] = stats_from_vector(
                _combine(rows),
                recipe=self.recipe,
                role=key[1],
                fp8_format=self.fp8_format,
                numel=numel,
            )
        return result


def _combine(rows: list[list[float]]) -> list[float]:
    """One STATS_FIELDS row from a step's micro-batch rows: counts summed, amax and scale_max
    the largest, scale_min the smallest, scale and num_scales the last."""
    columns = dict(zip(STATS_FIELDS, zip(*rows)))
    combined = {name: column[-1] for name, column in columns.items()}
    for name in ("saturated", "flushed", "nonzero"):
        combined[name] = sum(columns[name])
    combined["amax"], combined["scale_max"] = max(columns["amax"]), max(columns["scale_max"])
    combined["scale_min"] = min(columns["scale_min"])
    return [combined[name] for name in STATS_FIELDS]


def scalars(stats: dict[tuple[str, str], Fp8TensorStats]) -> dict[str, float]:
    """TensorBoard/W&B series: fp8-stats/<linear>/<role>/{amax,scale,saturated,underflow}."""
    series = {}
    for (name, role), item in stats.items():
        prefix = f"fp8-stats/{name}/{role}"
        series[f"{prefix}/amax"] = item.amax
        series[f"{prefix}/scale"] = item.scale
        series[f"{prefix}/saturated"] = item.saturated_fraction
        series[f"{prefix}/underflow"] = item.underflow_fraction
    return series


def log_lines(iteration: int, stats: dict[tuple[str, str], Fp8TensorStats]) -> list[str]:
    """One line per role: the largest amax and, for each fraction, its largest values with
    the Linears they come from."""
    lines = []
    for role in ROLES_LOGGED:
        items = {name: item for (name, r), item in stats.items() if r == role}
        if not items:
            continue
        amax_name = max(items, key=lambda name: items[name].amax)
        parts = [
            f" > fp8 stats iteration {iteration} | {role} ({len(items)} Linears)",
            f"max amax: {items[amax_name].amax:.4g} ({amax_name})",
            _worst(items, "saturated", lambda item: item.saturated_fraction),
            _worst(items, "underflow", lambda item: item.underflow_fraction),
        ]
        lines.append(" | ".join(parts))
    return lines


def _worst(items: dict[str, Fp8TensorStats], what: str, value: Callable) -> str:
    ranked = sorted(items, key=lambda name: value(items[name]), reverse=True)[:WORST_SHOWN]
    shown = ", ".join(f"{value(items[name]):.3e} {name}" for name in ranked)
    return f"{what}: {shown}"
