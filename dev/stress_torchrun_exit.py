"""Launch the same short 2-rank CPU torchrun run of pretrain_gpt.py many times and count the
runs that fail or hang; a hung run's ranks print their stacks (tests/launch.py) into a file.

    python dev/stress_torchrun_exit.py --runs 120 --out /tmp/stress   # ~5 s a run

Two copies side by side load the 2-core machine the way CI does; that is how an exit hang that
CI met once showed up here (9 of 240 runs before the fix, 0 of 240 after).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.launch import run_torchrun  # noqa: E402
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT  # noqa: E402

TINY_RUN = TINY_GPT + NO_DROPOUT + ["--train-iters", "6"]


def launch_once(timeout_s: float) -> tuple[str, str, str]:
    """(status, stdout, stderr): status is "ok", "exit N" or "hang"."""
    status, stdout, stderr = run_torchrun(
        ["pretrain_gpt.py", *TINY_RUN], nproc=2, cwd=REPO_ROOT, timeout_s=timeout_s
    )
    if status is None:
        return "hang", stdout, stderr
    return ("ok" if status == 0 else f"exit {status}"), stdout, stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=120)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True, help="where failed runs' logs go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for run in range(args.runs):
        status, stdout, stderr = launch_once(args.timeout_s)
        if status != "ok":
            failed += 1
            log = args.out / f"run_{os.getpid()}_{run:04d}.log"
            log.write_text(f"{status}\n{stdout}\n===== stderr =====\n{stderr}")
            print(f"run {run}: {status} (log: {log})", flush=True)
    print(f"{failed} of {args.runs} runs failed or hung", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
