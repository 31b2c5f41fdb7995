"""Launching training subprocesses from tests: a free port, and a timeout that shows where the
ranks were stuck before it kills them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

STACK_PRINT_PAUSE_S = 1.0
"""Between two processes' SIGABRTs, so that their stacks do not interleave on a shared stderr."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stack_dumping_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with Python's faulthandler on: SIGABRT then prints every thread's stack."""
    return {**env, "PYTHONFAULTHANDLER": "1"}


def start_session(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen in a new session with faulthandler on, for end_session_with_stacks."""
    env = stack_dumping_env(popen_kwargs.pop("env", None) or dict(os.environ))
    return subprocess.Popen(command, env=env, start_new_session=True, **popen_kwargs)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first), from /proc. torchrun starts each worker
    in a session of its own, so signalling torchrun's process group misses them."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found.extend(children)
        frontier = children
    return found


def _signal_all(pids: list[int], sig: signal.Signals, *, pause_s: float = 0.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        time.sleep(pause_s)


def end_session_with_stacks(process: subprocess.Popen) -> None:
    """A run past its limit: print where each process below `process` is stuck, then kill all.

    `process` (torchrun) is paused first, so that it cannot end the other workers when the first
    one dies; each worker then gets SIGABRT (faulthandler prints its threads' stacks), one at a
    time; finally everything gets SIGKILL."""
    stuck = descendants(process.pid)
    _signal_all([process.pid], signal.SIGSTOP)
    _signal_all(stuck, signal.SIGABRT, pause_s=STACK_PRINT_PAUSE_S)
    _signal_all([process.pid, *stuck], signal.SIGKILL)
    process.wait()


def run_torchrun(
    script_argv: list[str],
    *,
    nproc: int,
    cwd: str | os.PathLike,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> tuple[int | None, str, str]:
    """`torchrun --nproc-per-node nproc <script_argv>` on 127.0.0.1 with one intra-op thread
    (and `env` on top of this process's environment).

    Returns (exit status, stdout, stderr); the status is None when the run passed timeout_s,
    and its stderr then ends with the stuck ranks' stacks (end_session_with_stacks)."""
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
        *script_argv,
    ]
    process = start_session(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_session_with_stacks(process)
        stdout, stderr = process.communicate()
        return None, stdout, stderr
    return process.returncode, stdout, stderr
