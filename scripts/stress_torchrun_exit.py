"""Launch the same short 2-rank CPU torchrun run of pretrain_gpt.py many times and count the
runs that fail or hang; a hung run's ranks print their stacks (tests/launch.py) into a file.

    python scripts/stress_torchrun_exit.py --runs 120 --out /tmp/stress   # ~5 s a run

Two copies side by side load the 2-core machine the way CI does; that is how an exit hang that
CI met once showed up here (9 of 240 runs before the fix, 0 of 240 after).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.launch import end_session_with_stacks, free_port, start_session  # noqa: E402

TINY_RUN = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
    "--log-interval 1 --eval-iters 0 --lr 1e-3 --seed 1234 --train-iters 6 --hidden-dropout 0 "
    "--attention-dropout 0"
).split()


def launch_once(timeout_s: float) -> tuple[str, str, str]:
    """(status, stdout, stderr): status is "ok", "exit N" or "hang"."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "pretrain_gpt.py", *TINY_RUN,
    ]  # fmt: skip
    process = start_session(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_session_with_stacks(process)
        stdout, stderr = process.communicate()
        return "hang", stdout, stderr
    return ("ok" if process.returncode == 0 else f"exit {process.returncode}"), stdout, stderr


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
