"""Plot lm loss (and optionally grad norm, throughput, validation loss) against iteration for one
or more training runs, read from training logs or TensorBoard directories.

    python3 tools/plot_losses.py run_bf16.log run_mxfp8.log --output losses.png
    python3 tools/plot_losses.py tb/bf16 tb/mxfp8 --labels bf16 mxfp8 --grad-norm --throughput \
        --output losses.png

Series use the MetricsLogger metric names (megatron/training/loggers.py) whichever the source,
so a log and a TensorBoard directory of the same run give the same keys. `parse_log` /
`parse_log_lines` are the one parser of the training log format; tests reuse them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30

# Training-log field -> (metric name, factor to the metric's unit).
LOG_FIELDS: dict[str, tuple[str, float]] = {
    "consumed samples": ("consumed-samples", 1.0),
    "elapsed time per iteration (ms)": ("iteration-time", 1e-3),  # metric is in seconds
    "throughput per GPU (TFLOP/s/GPU)": ("throughput/tflops-per-gpu", 1.0),
    "tokens per GPU (tokens/s/GPU)": ("throughput/tokens-per-sec-per-gpu", 1.0),
    "learning rate": ("learning-rate", 1.0),
    "global batch size": ("batch-size", 1.0),
    "lm loss": ("lm loss", 1.0),
    "loss scale": ("loss-scale", 1.0),
    "grad norm": ("grad-norm", 1.0),
    "num zeros": ("num-zeros", 1.0),
    "params norm": ("params-norm", 1.0),
    "number of skipped iterations": ("skipped-iterations", 1.0),
    "number of nan iterations": ("nan-iterations", 1.0),
    "mem allocated (GiB)": ("mem-allocated-bytes", float(GIB)),
}
VALIDATION_FIELDS: dict[str, str] = {
    "lm loss value": "lm loss validation",
    "lm loss PPL": "lm loss validation ppl",
}
VALIDATION_METRICS = frozenset(VALIDATION_FIELDS.values())

RUN_LINE = re.compile(r"> megatron-fp8 run: (?P<settings>.*)$")
ITERATION_LINE = re.compile(
    r"\biteration\s+(?P<iteration>\d+)\s*/\s*(?P<total>\d+)\s*\|(?P<rest>.*)$"
)
VALIDATION_LINE = re.compile(
    r"\bvalidation loss at iteration\s+(?P<iteration>\d+)\s*\|(?P<rest>.*)$"
)


@dataclass
class Run:
    """One training run's scalar series.

    `series[name][i]` is the value at `iterations[i]` (NaN where a line lacked the field);
    validation metrics live in `validation_series` at `validation_iterations`.
    """

    label: str
    iterations: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)
    validation_iterations: list[int] = field(default_factory=list)
    validation_series: dict[str, list[float]] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    """key=value pairs of the log's run line (fp8-recipe, data-parallel-size, ...)."""

    @property
    def recipe(self) -> str | None:
        return self.settings.get("fp8-recipe")

    @property
    def data_parallel_size(self) -> int | None:
        size = self.settings.get("data-parallel-size")
        return None if size is None else int(size)

    def points(self, metric: str) -> tuple[list[int], list[float]]:
        """(x, y) of one metric, from the training or the validation series."""
        if metric in self.series:
            return self.iterations, self.series[metric]
        if metric in self.validation_series:
            return self.validation_iterations, self.validation_series[metric]
        available = sorted([*self.series, *self.validation_series])
        raise ValueError(f"run {self.label!r} has no {metric!r} series (it has {available})")


def _fields(rest: str) -> dict[str, str]:
    """'key: value | key: value |' -> {key: value}."""
    pairs = {}
    for part in rest.split("|"):
        key, sep, value = part.partition(":")
        if sep:
            pairs[key.strip()] = value.strip()
    return pairs


def _rows_to_series(rows: dict[int, dict[str, float]]) -> tuple[list[int], dict[str, list[float]]]:
    iterations = sorted(rows)
    names = sorted({name for row in rows.values() for name in row})
    series = {name: [rows[it].get(name, math.nan) for it in iterations] for name in names}
    return iterations, series


def _parse_iteration_fields(rest: str, source: str, line_number: int) -> dict[str, float]:
    row: dict[str, float] = {}
    for key, value in _fields(rest).items():
        name, factor = LOG_FIELDS.get(key, (key, 1.0))
        try:
            row[name] = float(value) * factor
        except ValueError as error:
            raise ValueError(
                f"{source}:{line_number}: field {key!r} has value {value!r}, not a number; "
                "is this log from a different megatron-fp8 version?"
            ) from error
    return row


def _run_label(settings: dict[str, str]) -> str | None:
    """The FP8 recipe, or for a run without FP8 the dtype it trained in (logs from before the
    run line named the dtype said fp8-recipe=bf16 for any run without FP8)."""
    recipe = settings.get("fp8-recipe")
    if recipe == "none":
        return settings.get("params-dtype")
    return recipe


def parse_log_lines(lines: Iterable[str], *, source: str, label: str | None = None) -> Run:
    """Parse training-log lines (see module docstring). A repeated iteration (a resumed run)
    keeps the later line. The label defaults to the run line's fp8-recipe (its params-dtype
    without FP8), else `source`."""
    settings: dict[str, str] = {}
    train_rows: dict[int, dict[str, float]] = {}
    validation_rows: dict[int, dict[str, float]] = {}
    for line_number, line in enumerate(lines, start=1):
        if match := RUN_LINE.search(line):
            settings = dict(pair.split("=", 1) for pair in match["settings"].split() if "=" in pair)
        elif match := ITERATION_LINE.search(line):
            row = _parse_iteration_fields(match["rest"], source, line_number)
            train_rows[int(match["iteration"])] = row
        elif match := VALIDATION_LINE.search(line):
            fields = _fields(match["rest"])
            validation_rows[int(match["iteration"])] = {
                name: float(fields[key]) for key, name in VALIDATION_FIELDS.items() if key in fields
            }
    if not train_rows:
        raise ValueError(
            f"{source} has no training iteration lines ('iteration N/ M | ... | lm loss: ...'); "
            "is it a megatron-fp8 training log with --log-interval set?"
        )
    iterations, series = _rows_to_series(train_rows)
    validation_iterations, validation_series = _rows_to_series(validation_rows)
    return Run(
        label=label or _run_label(settings) or source,
        iterations=iterations,
        series=series,
        validation_iterations=validation_iterations,
        validation_series=validation_series,
        settings=settings,
    )


def parse_log(path: str, label: str | None = None) -> Run:
    """Parse one training log file."""
    with open(path, encoding="utf-8", errors="replace") as log_file:
        return parse_log_lines(log_file, source=path, label=label)


def read_tensorboard_run(log_dir: str, label: str | None = None) -> Run:
    """A Run from the scalars MetricsLogger wrote to a TensorBoard directory."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import (
            SCALARS,
            EventAccumulator,
        )
    except ImportError as error:
        raise ImportError(
            f"reading the TensorBoard directory {log_dir} needs `pip install tensorboard`"
        ) from error
    accumulator = EventAccumulator(log_dir, size_guidance={SCALARS: 0})
    accumulator.Reload()
    train_rows: dict[int, dict[str, float]] = {}
    validation_rows: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags()[SCALARS]:
        rows = validation_rows if tag in VALIDATION_METRICS else train_rows
        for event in accumulator.Scalars(tag):
            rows.setdefault(event.step, {})[tag] = event.value
    if not train_rows:
        raise ValueError(f"{log_dir} has no TensorBoard scalars; is it a --tensorboard-dir?")
    iterations, series = _rows_to_series(train_rows)
    validation_iterations, validation_series = _rows_to_series(validation_rows)
    return Run(
        label=label or os.path.basename(os.path.normpath(log_dir)),
        iterations=iterations,
        series=series,
        validation_iterations=validation_iterations,
        validation_series=validation_series,
    )


def load_run(path: str, label: str | None = None) -> Run:
    """A training log file or a TensorBoard directory."""
    if os.path.isdir(path):
        return read_tensorboard_run(path, label)
    if os.path.isfile(path):
        return parse_log(path, label)
    raise FileNotFoundError(f"{path} is neither a training log file nor a TensorBoard directory")


def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: run `pip install matplotlib` "
            "(or `pip install -e .[plot]`)"
        ) from error
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_runs(
    runs: Sequence[Run],
    *,
    output: str,
    metrics: Sequence[str] = ("lm loss",),
    width_px: int = 1000,
    panel_height_px: int = 400,
    dpi: int = 100,
) -> Any:
    """One panel per metric (shared x = iteration), one line per run labelled run.label;
    writes a width_px x (panel_height_px * len(metrics)) PNG to `output` and returns the
    matplotlib Figure."""
    if not runs:
        raise ValueError("plot_runs needs at least one run")
    if not metrics:
        raise ValueError("plot_runs needs at least one metric")
    pyplot = _import_pyplot()
    figure, axes = pyplot.subplots(
        len(metrics),
        1,
        sharex=True,
        squeeze=False,
        figsize=(width_px / dpi, panel_height_px * len(metrics) / dpi),
        dpi=dpi,
    )
    for axis, metric in zip(axes[:, 0], metrics):
        for run in runs:
            x, y = run.points(metric)
            axis.plot(x, y, label=run.label, marker="o" if metric in VALIDATION_METRICS else None)
        axis.set_ylabel(metric)
        axis.grid(True, alpha=0.3)
        axis.legend()
    axes[-1, 0].set_xlabel("iteration")
    figure.tight_layout()
    output_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(output_dir, exist_ok=True)
    figure.savefig(output, dpi=dpi)
    return figure


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="training log files or TensorBoard directories")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: recipe)")
    parser.add_argument("--grad-norm", action="store_true", help="add a grad-norm panel")
    parser.add_argument("--throughput", action="store_true", help="add a TFLOP/s/GPU panel")
    parser.add_argument("--validation", action="store_true", help="add a validation-loss panel")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs")
    return args


def main(argv: Sequence[str] | None = None) -> Any:
    """The command line; returns the matplotlib Figure it saved."""
    args = _parse_args(argv)
    try:
        _import_pyplot()  # before reading the logs: a missing package is one line, not a traceback
    except ImportError as error:
        raise SystemExit(f"error: {error}") from None
    labels = args.labels or [None] * len(args.runs)
    try:
        runs = [load_run(path, label) for path, label in zip(args.runs, labels)]
    except (OSError, ValueError) as error:  # a missing or unreadable log: one line, status 2
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.labels is None:
        # Two runs of one recipe would share a legend entry: add the file name.
        duplicated = {run.label for run in runs if [r.label for r in runs].count(run.label) > 1}
        for path, run in zip(args.runs, runs):
            if run.label in duplicated:
                run.label = f"{run.label} ({os.path.basename(os.path.normpath(path))})"
    metrics = ["lm loss"]
    metrics += ["grad-norm"] if args.grad_norm else []
    metrics += ["throughput/tflops-per-gpu"] if args.throughput else []
    metrics += ["lm loss validation"] if args.validation else []
    figure = plot_runs(runs, output=args.output, metrics=metrics)
    print(f"wrote {args.output}: {len(runs)} run(s), panels {metrics}")
    return figure


if __name__ == "__main__":
    main()
