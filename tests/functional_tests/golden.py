"""Golden values: read them from a training log, store them as JSON, compare a run against them.

File format (Megatron-LM's), one entry per metric:

    {"lm loss": {"start_step": 1, "end_step": 20, "step_interval": 1,
                 "values": {"1": 6.249408, "2": 6.21188, ...}}, ...}

Rules:
- "lm loss" and "grad norm" per step: in deterministic mode the printed strings must be equal
  (lm loss as `%.6E`, grad norm as `%.3f`, exactly as the log prints them); otherwise each step
  within the case's relative tolerance (grad norm may also differ by its print resolution).
- "iteration-time" and "mem-allocated-bytes": the median over a steady window (the first
  STEADY_SKIP logged steps dropped: allocator warm-up, first-step graph building, and the first
  step after a resume) within a wide band, since timings vary with machine load.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.plot_losses import Run

# Golden metric name -> series name in tools.plot_losses.Run.
GOLDEN_METRICS: dict[str, str] = {
    "lm loss": "lm loss",
    "grad norm": "grad-norm",
    "iteration-time": "iteration-time",
    "mem-allocated-bytes": "mem-allocated-bytes",
}
PER_STEP_METRICS = ("lm loss", "grad norm")
WINDOW_METRICS = ("iteration-time", "mem-allocated-bytes")
# The log's own formats: equal strings under them is what "exact" means.
PRINT_FORMATS = {
    "lm loss": "{:.6E}",
    "grad norm": "{:.3f}",
    "iteration-time": "{:.4f}",  # seconds
    "mem-allocated-bytes": "{:.0f}",
}
PRINT_RESOLUTION = {"lm loss": 0.0, "grad norm": 0.0005}
STEADY_SKIP = 5
TIME_FACTOR = 3.0
MEMORY_RELATIVE = 0.5
MAX_TABLE_ROWS = 25

Values = dict[int, float]


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    deterministic: bool
    relative: float
    """lm loss / grad norm relative tolerance when not deterministic."""
    grad_norm_relative: float | None = None
    """grad norm's own relative tolerance, where it differs (None: `relative`)."""
    time_factor: float = TIME_FACTOR
    memory_relative: float = MEMORY_RELATIVE
    steady_skip: int = STEADY_SKIP
    origin: str = ""
    """Why this rule applies (which golden kind against which machine), shown in reports."""


def relative_tolerance(metric: str, tolerance: Tolerance) -> float:
    if metric == "grad norm" and tolerance.grad_norm_relative is not None:
        return tolerance.grad_norm_relative
    return tolerance.relative


@dataclass(frozen=True, kw_only=True)
class Row:
    step: str
    golden: str
    actual: str
    difference: str
    relative: str


@dataclass(kw_only=True)
class MetricReport:
    metric: str
    rule: str
    rows: list[Row] = field(default_factory=list)
    """The failing steps (or the failing window); empty when the metric passed."""

    @property
    def passed(self) -> bool:
        return not self.rows


def metrics_from_run(run: Run) -> dict[str, Values]:
    """The golden metrics of a parsed log, {metric: {step: value}}; NaN entries dropped."""
    metrics: dict[str, Values] = {}
    for golden_name, series_name in GOLDEN_METRICS.items():
        series = run.series.get(series_name, [])
        metrics[golden_name] = {
            step: value for step, value in zip(run.iterations, series) if not math.isnan(value)
        }
    return metrics


def to_golden_json(metrics: dict[str, Values]) -> dict[str, dict]:
    golden = {}
    for name, values in metrics.items():
        steps = sorted(values)
        interval = steps[1] - steps[0] if len(steps) > 1 else 1
        golden[name] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": interval,
            "values": {str(step): values[step] for step in steps},
        }
    return golden


# The entry that records the machine a golden file was written on (machine.cpu_fingerprint);
# every other top-level entry is a metric in Megatron-LM's format.
MACHINE_KEY = "machine"


def write_golden(
    path: Path,
    metrics: dict[str, Values],
    *,
    force: bool,
    machine: dict[str, str] | None = None,
) -> None:
    """Write golden values (and the recording machine's fingerprint, where given); refuse to
    replace an existing file unless `force`."""
    if path.exists() and not force:
        raise FileExistsError(
            f"{path} exists; pass --force to overwrite it (check the new numbers first)"
        )
    golden = to_golden_json(metrics)
    if machine is not None:
        golden[MACHINE_KEY] = dict(machine)
    path.write_text(json.dumps(golden, indent=2) + "\n")


def read_golden(path: Path) -> dict[str, Values]:
    raw = json.loads(path.read_text())
    return {
        name: {int(step): float(v) for step, v in entry["values"].items()}
        for name, entry in raw.items()
        if name != MACHINE_KEY
    }


def read_machine(path: Path) -> dict[str, str] | None:
    """The fingerprint of the machine that recorded `path`, or None where none was recorded."""
    return json.loads(path.read_text()).get(MACHINE_KEY)


def _relative(golden: float, actual: float) -> float:
    if golden == 0.0:
        return 0.0 if actual == 0.0 else math.inf
    return (actual - golden) / abs(golden)


def _format(metric: str, value: float | None) -> str:
    if value is None:
        return "missing"
    return PRINT_FORMATS[metric].format(value)


def _differences(golden: float | None, actual: float | None) -> dict[str, str]:
    """The table's difference and relative columns: actual - golden, and that over |golden|."""
    if golden is None or actual is None:
        return {"difference": "-", "relative": "-"}
    return {
        "difference": f"{actual - golden:+.3E}",
        "relative": f"{100.0 * _relative(golden, actual):+.3f}%",
    }


def _step_matches(metric: str, *, golden: float, actual: float, tolerance: Tolerance) -> bool:
    if tolerance.deterministic:
        return _format(metric, golden) == _format(metric, actual)
    allowed = relative_tolerance(metric, tolerance) * abs(golden) + PRINT_RESOLUTION[metric]
    return abs(actual - golden) <= allowed


def compare_per_step(
    metric: str, *, golden: Values, actual: Values, tolerance: Tolerance
) -> MetricReport:
    rule = (
        "printed values equal"
        if tolerance.deterministic
        else f"within {100.0 * relative_tolerance(metric, tolerance):g}% relative"
    )
    if tolerance.origin:
        rule = f"{rule}; {tolerance.origin}"
    report = MetricReport(metric=metric, rule=rule)
    for step in sorted(set(golden) | set(actual)):
        want, got = golden.get(step), actual.get(step)
        if (
            want is not None
            and got is not None
            and _step_matches(metric, golden=want, actual=got, tolerance=tolerance)
        ):
            continue
        report.rows.append(
            Row(
                step=str(step),
                golden=_format(metric, want),
                actual=_format(metric, got),
                **_differences(want, got),
            )
        )
    return report


def steady_median(values: Values, *, skip: int) -> tuple[float, str] | None:
    """(median over the steps after the first `skip`, "median A-B"); a run with no more than
    `skip` steps uses its last step; None when there are no steps."""
    steps = sorted(values)[skip:] or sorted(values)[-1:]
    if not steps:
        return None
    median = statistics.median(values[step] for step in steps)
    return median, f"median {steps[0]}-{steps[-1]}"


def compare_window(
    metric: str, *, golden: Values, actual: Values, tolerance: Tolerance
) -> MetricReport:
    if metric == "iteration-time":
        factor = tolerance.time_factor
        rule = f"steady median within {factor:g}x"
        inside = lambda want, got: want / factor <= got <= want * factor
    else:
        share = tolerance.memory_relative
        rule = f"steady median within {100.0 * share:g}%"
        inside = lambda want, got: abs(got - want) <= share * abs(want)
    report = MetricReport(metric=metric, rule=rule)
    want = steady_median(golden, skip=tolerance.steady_skip)
    got = steady_median(actual, skip=tolerance.steady_skip)
    if want is None:
        return report
    if got is None or not inside(want[0], got[0]):
        report.rows.append(
            Row(
                step=want[1],
                golden=_format(metric, want[0]),
                actual=_format(metric, None if got is None else got[0]),
                **_differences(want[0], None if got is None else got[0]),
            )
        )
    return report


def compare_metrics(
    *, golden: dict[str, Values], actual: dict[str, Values], tolerance: Tolerance
) -> list[MetricReport]:
    """One report per golden metric, in GOLDEN_METRICS order."""
    reports = []
    for metric in GOLDEN_METRICS:
        if metric not in golden:
            continue
        compare = compare_per_step if metric in PER_STEP_METRICS else compare_window
        reports.append(
            compare(
                metric, golden=golden[metric], actual=actual.get(metric, {}), tolerance=tolerance
            )
        )
    return reports


def format_table(rows: Sequence[Row], *, max_rows: int = MAX_TABLE_ROWS) -> str:
    header = Row(
        step="step", golden="golden", actual="actual", difference="difference", relative="relative"
    )
    shown = [header, *rows[:max_rows]]
    widths = [
        max(len(getattr(row, column)) for row in shown) for column in Row.__dataclass_fields__
    ]
    lines = [
        "  ".join(
            getattr(row, column).rjust(width)
            for column, width in zip(Row.__dataclass_fields__, widths)
        ).rstrip()
        for row in shown
    ]
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows")
    return "\n".join(lines)


def format_reports(reports: Sequence[MetricReport]) -> str:
    """Readable summary: one line per metric, and a table under each failing one."""
    blocks = []
    for report in reports:
        if report.passed:
            blocks.append(f"{report.metric}: ok ({report.rule})")
            continue
        blocks.append(
            f"{report.metric}: MISMATCH ({report.rule}), {len(report.rows)} row(s):\n"
            + format_table(report.rows)
        )
    return "\n".join(blocks)
