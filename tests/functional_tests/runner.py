"""Run functional test cases and compare them against their golden values.

    python3 -m tests.functional_tests.runner --case gpt_ddp_bf16
    python3 -m tests.functional_tests.runner --all
    python3 -m tests.functional_tests.runner --case gpt_h200_zero3_bf16 --platform h200 --regenerate

A case trains with `python3 -m torch.distributed.run --nproc-per-node N pretrain_gpt.py ...`
(twice for a RESUME case: to `stop_at` with --save/--exit-interval, then with --load on
`nproc_after` ranks, into the same log), the log is parsed by tools/plot_losses.parse_log and
compared by golden.compare_metrics. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.functional_tests.cases import (
    CASES_ROOT,
    Case,
    current_platform,
    discover_cases,
    find_case,
    model_args_to_argv,
)
from tests.functional_tests.golden import (
    MetricReport,
    Tolerance,
    Values,
    compare_metrics,
    format_reports,
    metrics_from_run,
    read_golden,
    read_machine,
    write_golden,
)
from tests.functional_tests.machine import (
    CROSS_CPU_RELATIVE,
    cpu_fingerprint,
    describe,
    golden_tag,
    same_machine,
)
from tests.launch import end_session_with_stacks, free_port, start_session
from tools.plot_losses import parse_log

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT_DIR = REPO_ROOT / "runs" / "functional_tests"
LAUNCH_TIMEOUT_S = 600
LOG_TAIL_LINES = 40


class LaunchError(RuntimeError):
    """A training launch exited non-zero, timed out, or logged too few iterations."""


class MissingGoldenError(FileNotFoundError):
    """The case has no golden values for this platform yet."""


@dataclass(kw_only=True)
class CaseResult:
    case: Case
    log_path: Path
    metrics: dict[str, Values]
    reports: list[MetricReport] = field(default_factory=list)
    seconds: float = 0.0
    regenerated: bool = False
    golden_path: Path | None = None
    """The golden file compared with (or written)."""

    @property
    def passed(self) -> bool:
        return all(report.passed for report in self.reports)


def regenerate_command(case: Case, platform: str) -> str:
    return (
        f"python3 -m tests.functional_tests.runner --case {case.name} --platform {platform} "
        "--regenerate"
    )


def skip_reason(case: Case, platform: str) -> str | None:
    if case.platform == platform:
        return None
    return f"{case.name} runs on platform {case.platform!r}; this machine is {platform!r}"


# A Python exception of a rank, or a native abort (which leaves no traceback).
ERROR_LINE = re.compile(
    r"\b(?!ChildFailedError)\w*(Error|Exception): |terminate called|Fatal Python error|"
    r"Segmentation fault"
)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's last lines, led by its first exception line: torchrun's own report comes last
    and names no cause."""
    text = path.read_text(errors="replace").splitlines()
    first_error = next((line for line in text if ERROR_LINE.search(line)), None)
    tail = "\n".join(text[-lines:])
    return tail if first_error is None else f"first error: {first_error}\n{tail}"


# Bitwise CPU goldens need the same float kernels on every x86-64 machine: ATen, MKL and oneDNN
# otherwise take AVX-512 code where the CPU has it, which sums in another order (seen: an AMD
# EPYC with AVX-512 missed goldens recorded on an AVX2 machine by ~1e-5 from the second step,
# and matched them with these set).
PINNED_CPU_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def launch(
    *, case: Case, nproc: int, extra_argv: Sequence[str], log_path: Path, timeout_s: int
) -> None:
    """One torchrun launch of pretrain_gpt.py with the case's flags, appended to `log_path`."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "pretrain_gpt.py",
        *model_args_to_argv(case.model_args),
        *extra_argv,
    ]
    pinned = PINNED_CPU_KERNELS if case.platform == "cpu" else {}
    env = {**os.environ, **pinned, **case.env_vars}
    with log_path.open("a") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        process = start_session(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_session_with_stacks(process)
            raise LaunchError(
                f"{case.name}: launch ran past {timeout_s} s (stacks of the stuck ranks, "
                f"printed at SIGABRT, are in the log); last lines of {log_path}:\n"
                + _tail(log_path)
            ) from None
    if status != 0:
        raise LaunchError(
            f"{case.name}: `{shlex.join(command)}` exited with status {status}; last lines of "
            f"{log_path}:\n{_tail(log_path)}"
        )


def run_training(case: Case, *, workdir: Path, timeout_s: int = LAUNCH_TIMEOUT_S) -> Path:
    """Train the case (both halves of a RESUME case) into <workdir>/train.log; return its path."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "train.log"
    log_path.unlink(missing_ok=True)
    if case.resume is None:
        launch(case=case, nproc=case.nproc, extra_argv=[], log_path=log_path, timeout_s=timeout_s)
        return log_path
    checkpoints = workdir / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)
    first_half = ["--save", str(checkpoints), "--exit-interval", str(case.resume.stop_at)]
    launch(
        case=case, nproc=case.nproc, extra_argv=first_half, log_path=log_path, timeout_s=timeout_s
    )
    launch(
        case=case,
        nproc=case.resume.nproc_after,
        extra_argv=["--load", str(checkpoints)],
        log_path=log_path,
        timeout_s=timeout_s,
    )
    return log_path


def collect_metrics(case: Case, log_path: Path) -> dict[str, Values]:
    """The golden metrics of a finished log; LaunchError if it stopped short of train-iters."""
    run = parse_log(str(log_path))
    if not run.iterations or run.iterations[-1] != case.train_iters:
        last = run.iterations[-1] if run.iterations else None
        raise LaunchError(
            f"{case.name}: the log ends at iteration {last}, not train-iters {case.train_iters}; "
            f"last lines of {log_path}:\n{_tail(log_path)}"
        )
    return metrics_from_run(run)


def tolerance_of(case: Case) -> Tolerance:
    return Tolerance(
        deterministic=case.deterministic,
        relative=case.tolerance,
        grad_norm_relative=case.grad_norm_tolerance,
        time_factor=case.time_factor,
    )


@dataclass(frozen=True, kw_only=True)
class GoldenChoice:
    path: Path
    tolerance: Tolerance


def choose_golden(case: Case, *, platform: str, machine: dict[str, str]) -> GoldenChoice:
    """The golden file to compare with and the rule (machine.py): a deterministic case compares
    exactly against the golden kind recorded on this very machine; without one, against the
    kind of the same CPU vendor (else the primary file) within CROSS_CPU_RELATIVE."""
    kinds = case.golden_kinds(platform)
    if not kinds:
        raise MissingGoldenError(
            f"{case.name}: no golden values for platform {platform!r} "
            f"({case.golden_path(platform)} is missing); run "
            f"`{regenerate_command(case, platform)}` on a {platform} machine and commit the file"
        )
    tolerance = tolerance_of(case)
    if not tolerance.deterministic:
        return GoldenChoice(path=kinds[0], tolerance=tolerance)
    recorded = {path: read_machine(path) for path in kinds}
    for path, fingerprint in recorded.items():
        if same_machine(fingerprint, machine):
            origin = f"golden recorded on this machine's CPU ({path.name})"
            return GoldenChoice(path=path, tolerance=dataclasses.replace(tolerance, origin=origin))
    same_vendor = [
        path
        for path, fingerprint in recorded.items()
        if fingerprint and fingerprint.get("cpu_vendor") == machine.get("cpu_vendor")
    ]
    path = (same_vendor or kinds)[0]
    origin = (
        f"cross-CPU rule: {path.name} was recorded on {describe(recorded[path])}, "
        f"this machine is {describe(machine)}"
    )
    cross = dataclasses.replace(
        tolerance,
        deterministic=False,
        relative=CROSS_CPU_RELATIVE["lm loss"],
        grad_norm_relative=CROSS_CPU_RELATIVE["grad norm"],
        origin=origin,
    )
    return GoldenChoice(path=path, tolerance=cross)


def regenerate_target(case: Case, *, platform: str, machine: dict[str, str]) -> Path:
    """Where --regenerate writes: the golden kind of this machine where one exists, else the
    primary file where none exists yet, else a new kind golden_values_<platform>.<tag>.json (a
    deterministic case keeps one kind per machine; the others stay for their machines)."""
    primary = case.golden_path(platform)
    if not case.deterministic:
        return primary
    for path in case.golden_kinds(platform):
        if same_machine(read_machine(path), machine):
            return path
    if not primary.exists():
        return primary
    return case.directory / f"golden_values_{platform}.{golden_tag(machine)}.json"


def run_case(
    case: Case,
    *,
    platform: str,
    workdir: Path,
    regenerate: bool = False,
    force: bool = False,
    machine: dict[str, str] | None = None,
) -> CaseResult:
    """Train the case and compare with (or, with `regenerate`, write) its golden values.
    `machine`: this machine's fingerprint (default: machine.cpu_fingerprint())."""
    machine = machine if machine is not None else cpu_fingerprint()
    if regenerate:
        golden_path = regenerate_target(case, platform=platform, machine=machine)
        if golden_path.exists() and not force:
            raise FileExistsError(
                f"{golden_path} exists; pass --force to overwrite it (check the new numbers first)"
            )
    else:
        choice = choose_golden(case, platform=platform, machine=machine)
    start = time.monotonic()
    log_path = run_training(case, workdir=workdir)
    metrics = collect_metrics(case, log_path)
    result = CaseResult(case=case, log_path=log_path, metrics=metrics)
    if regenerate:
        write_golden(golden_path, metrics, force=force, machine=machine)
        result.regenerated, result.golden_path = True, golden_path
    else:
        result.golden_path = choice.path
        result.reports = compare_metrics(
            golden=read_golden(choice.path), actual=metrics, tolerance=choice.tolerance
        )
    result.seconds = time.monotonic() - start
    return result


def _select_cases(args: argparse.Namespace) -> list[Case]:
    root = Path(args.cases_root)
    if args.all:
        return discover_cases(root)
    return [find_case(name, root) for name in args.case]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.functional_tests.runner",
        description="Run functional GPT cases against their golden values.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--case", action="append", help="Case name (repeatable).")
    which.add_argument("--all", action="store_true", help="Every case of --platform.")
    parser.add_argument(
        "--platform", default=None, help="Golden-value platform (default: this machine's)."
    )
    parser.add_argument(
        "--regenerate", action="store_true", help="Write golden values instead of comparing."
    )
    parser.add_argument(
        "--force", action="store_true", help="With --regenerate: overwrite existing goldens."
    )
    parser.add_argument(
        "--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="Logs and checkpoints go here."
    )
    parser.add_argument("--cases-root", default=str(CASES_ROOT), help="Where the cases live.")
    return parser


def _run_one(case: Case, *, args: argparse.Namespace, platform: str) -> bool:
    """Run one case and print its outcome; True when it passed (or was regenerated)."""
    workdir = Path(args.output_dir) / case.name
    try:
        result = run_case(
            case, platform=platform, workdir=workdir, regenerate=args.regenerate, force=args.force
        )
    except (LaunchError, MissingGoldenError) as error:
        print(f"FAIL {case.name}: {error}", flush=True)
        return False
    if result.regenerated:
        print(f"WROTE {result.golden_path} ({result.seconds:.1f} s)", flush=True)
        return True
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{verdict} {case.name} ({result.seconds:.1f} s, log {result.log_path})", flush=True)
    print(format_reports(result.reports), flush=True)
    return result.passed


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.force and not args.regenerate:
        print("--force only applies with --regenerate", file=sys.stderr)
        return 2
    platform = args.platform or current_platform()
    cases = _select_cases(args)
    runnable = []
    for case in cases:
        reason = skip_reason(case, platform)
        if reason is None:
            runnable.append(case)
        else:
            print(f"SKIP {case.name}: {reason}", flush=True)
    machine = cpu_fingerprint()
    targets = [regenerate_target(case, platform=platform, machine=machine) for case in runnable]
    existing = [path for path in targets if path.exists()]
    if args.regenerate and existing and not args.force:
        listing = "\n  ".join(str(path) for path in existing)
        print(
            f"refusing to overwrite existing golden values without --force:\n  {listing}",
            file=sys.stderr,
        )
        return 2
    start = time.monotonic()
    failed = [case.name for case in runnable if not _run_one(case, args=args, platform=platform)]
    print(
        f"{len(runnable) - len(failed)} passed, {len(failed)} failed, "
        f"{len(cases) - len(runnable)} skipped in {time.monotonic() - start:.1f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
