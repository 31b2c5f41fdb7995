"""The fidelity suite's results (benchmarks/fidelity_suite.py): each run's validation loss at
its last iteration read from its log, whether the command that made a log is the run's, the
paired summary per job x card x recipe, and its table.

A run's result is the validation loss at iteration --train-iters, nothing earlier: a run that
stopped short (--stop-after-mins, a crash) or evaluated on the way (an --extra --eval-interval)
has no result until it reaches its end. A recipe's verdict names the seeds whose run (or bf16's)
ended without that loss, and how many of the job's seeds the pairs cover.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.fidelity_stats import paired_ratio_summary  # noqa: E402
from tools.plot_losses import parse_log  # noqa: E402

CONTROL = "bf16_repeat"
"""--repeat-control's run: bf16 again at the same seed, paired with bf16 like a recipe: the noise
floor (GPU kernels that accumulate in a run-dependent order make same-seed runs drift apart)."""

PER_CALL_FLAGS = ("--exit-duration-in-mins", "--save", "--load")
"""Flags (with their value) that may differ between the calls that train one run: how long a
call trains, and where its checkpoint is (given by --checkpoint-dir, any spelling of it)."""


def final_validation(log: str, iters: int) -> float | None:
    """The validation loss `log` holds at iteration `iters`, None without one."""
    try:
        parsed = parse_log(log)
    except (OSError, ValueError):
        return None
    losses = parsed.validation_series.get("lm loss validation", [])
    value = dict(zip(parsed.validation_iterations, losses)).get(iters)
    return None if value is None or math.isnan(value) else value


def done(run: dict) -> bool:
    """Whether the run's log already holds its result."""
    return final_validation(run["log"], run["iters"]) is not None


def _comparable(words: list[str]) -> list[str]:
    kept, skip = [], False
    for word in words:
        if skip or word in PER_CALL_FLAGS:
            skip = not skip and word in PER_CALL_FLAGS
            continue
        kept.append(word)
    return kept


def command_change(run: dict) -> str | None:
    """How the command that wrote the run's log (its .cmd file) differs from the run's own, or
    None (the same but for PER_CALL_FLAGS, or no .cmd file): a log or checkpoint made with other
    data, model or flags is not this run's to skip or resume."""
    try:
        with open(run["log"] + ".cmd", encoding="utf-8") as handle:
            before = _comparable(shlex.split(handle.read()))
    except OSError:
        return None
    now = _comparable(run["command"][1:])
    if before == now:
        return None
    pairs = zip(before, now)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(now)))
    first -= 1 if first and before[first - 1].startswith("--") else 0  # from the value's flag
    return (
        f"'{' '.join(before[first : first + 2]) or '(end)'}' in the log's command, "
        f"'{' '.join(now[first : first + 2]) or '(end)'}' in this one"
    )


def read_card(log: str) -> str | None:
    try:
        with open(log + ".card", encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def card_label(earlier: str | None, card: str) -> str:
    """The cards a run trained on, in order ("A + B"), after a call on `card`."""
    cards = earlier.split(" + ") if earlier else []
    return " + ".join(cards if cards and cards[-1] == card else [*cards, card])


def run_state(row: dict) -> str:
    """ "done" (its result is in), "failed" (this call ran it and it ended without its result,
    short of a stop that a later call resumes) or "pending" (not run yet, or left to resume)."""
    if row.get("valid_loss") is not None:
        return "done"
    code = row.get("returncode")
    return "failed" if code is not None and (code != 0 or not row.get("left")) else "pending"


def read_results(runs: list[dict]) -> list[dict]:
    """Per run: its result, last training loss, the training-loss curve, its state."""
    rows = []
    for run in runs:
        keys = ("job", "corpus", "size", "iters", "epochs", "recipe", "seed")
        row = {k: run.get(k) for k in keys}
        row.update(returncode=run.get("returncode"), log=run["log"], valid_loss=None)
        row.update(left=run.get("left", False), card=read_card(run["log"]))
        try:
            parsed = parse_log(run["log"])
        except (OSError, ValueError):
            parsed = None
        if parsed is not None:
            losses = parsed.series.get("lm loss", [])
            row.update(iterations=parsed.iterations, train_losses=losses)
            row.update(train_loss=losses[-1] if losses else None)
            row.update(valid_loss=final_validation(run["log"], run["iters"]))
            row.update(fp8_stats=last_fp8_stats(run["log"]))
        row.update(state=run_state(row))
        rows.append(row)
    return rows


def last_fp8_stats(log: str) -> list[str]:
    """The run's last `--log-fp8-stats` lines, one per role (the latest of a step that a
    resumed run, its log appended to, logged twice), [] without any."""
    with open(log, encoding="utf-8", errors="replace") as handle:
        lines = [line.strip() for line in handle if line.lstrip().startswith("> fp8 stats")]
    last = lines[-1].split("|")[0] if lines else None
    by_role = {line.split("|")[1].split("(")[0].strip(): line for line in lines}
    return [line for line in by_role.values() if line.split("|")[0] == last]


def _qualified(summary: dict, recipe: str, failed: list, planned: list) -> str:
    """The verdict, or the failures that void it, with the share of the job's seeds paired."""
    if failed:
        return f"failed at seed(s) {', '.join(map(str, failed))}: no validation loss at the end"
    verdict = "the floor: bf16 against itself" if recipe == CONTROL else summary["verdict"]
    paired = len(summary["seeds"])
    return verdict if paired >= len(planned) else f"{verdict} ({paired} of {len(planned)} seeds)"


def summarize(rows: list[dict], recipes: list[str], tolerance: float) -> list[dict]:
    """One line per job x card x recipe: paired ratios, mean, 95% interval, verdict. A seed's
    recipe run pairs only with the bf16 run of that seed on the same card; the bf16 mean is
    over the paired seeds."""
    summaries = []
    for job, card in dict.fromkeys((row["job"], row.get("card")) for row in rows):
        losses, failed = {}, {}
        for row in rows:
            if row["job"] != job or row.get("card") != card:
                continue
            if row["valid_loss"] is not None:
                losses.setdefault(row["recipe"], {})[row["seed"]] = row["valid_loss"]
            elif row.get("state") == "failed":
                failed.setdefault(row["recipe"], set()).add(row["seed"])
        if not losses and not failed:
            continue
        bf16 = losses.get("bf16", {})
        planned = sorted({row["seed"] for row in rows if row["job"] == job})
        epochs = next((row.get("epochs") for row in rows if row["job"] == job), None)
        for recipe in recipes:
            summary = paired_ratio_summary(losses.get(recipe, {}), bf16, tolerance=tolerance)
            seeds_failed = sorted(failed.get(recipe, set()) | failed.get("bf16", set()))
            summary.update(verdict=_qualified(summary, recipe, seeds_failed, planned))
            paired_bf16 = [bf16[seed] for seed in summary["seeds"]]
            bf16_mean = sum(paired_bf16) / len(paired_bf16) if paired_bf16 else None
            line = dict(job=job, card=card, epochs=epochs, recipe=recipe, bf16_mean=bf16_mean)
            summaries.append(line | summary | dict(failed_seeds=seeds_failed))
    return summaries


def _fmt(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(summaries: list[dict]) -> str:
    lines = [
        "| job (corpus_size_steps[_mbsN]) | card | epochs | recipe | seeds | bf16 mean valid "
        "| mean fp8/bf16 | 95% interval | verdict | sd of ratios | seeds for a verdict "
        "| per-seed ratios |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ratios = ", ".join(f"{r:.4f}" for r in s["ratios"])
        lines.append(
            f"| {s['job']} | {s.get('card') or 'n/a'} | {_fmt(s.get('epochs'), 2)} "
            f"| {s['recipe']} | {len(s['seeds'])} "
            f"| {_fmt(s['bf16_mean'], 5)} "
            f"| {_fmt(s['mean'])} | [{_fmt(s['low'])}, {_fmt(s['high'])}] | {s['verdict']} "
            f"| {_fmt(s.get('sd'))} | {s.get('seeds_needed') or 'n/a'} | {ratios} |"
        )
    return "\n".join(lines) + "\n"
