"""scripts/launch_torchrun.sh: ranks, world size and arguments reach the entry script, single
node and two nodes (two launcher processes on this machine, as two hosts would run them)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = REPO_ROOT / "scripts" / "launch_torchrun.sh"
PROBE = REPO_ROOT / "tests" / "functional_tests" / "rendezvous_probe.py"
PROBE_LINE = re.compile(
    r"^probe rank=(\d+) world=(\d+) local_rank=(\d+) master=(\S+):(\d+) sum=(\S+) argv=(.*)$",
    re.MULTILINE,
)
ARGS = ["--num-layers", "2", "--wandb-exp-name", "name with spaces"]


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def _launcher_env(**topology: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    return {**env, "PYTHON": sys.executable, "MEGATRON_ENTRY": str(PROBE), **topology}


def _probes(output: str) -> list[tuple[int, int, int, str, int, float, list[str]]]:
    rows = [
        (int(r), int(w), int(lr), addr, int(port), float(total), json.loads(argv))
        for r, w, lr, addr, port, total, argv in PROBE_LINE.findall(output)
    ]
    return sorted(rows)


def test_single_node_two_processes() -> None:
    port = _free_port()
    env = _launcher_env(NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = subprocess.run(
        ["bash", str(LAUNCHER), *ARGS], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "node 0 of 1, 2 processes per node" in result.stdout
    # all-reduce of rank + 1 over two ranks = 3
    assert _probes(result.stdout) == [
        (0, 2, 0, "127.0.0.1", port, 3.0, ARGS),
        (1, 2, 1, "127.0.0.1", port, 3.0, ARGS),
    ]


def test_two_nodes_one_process_each() -> None:
    port = _free_port()
    launchers = [
        subprocess.Popen(
            ["bash", str(LAUNCHER), *ARGS],
            env=_launcher_env(
                NNODES="2",
                NODE_RANK=str(node_rank),
                NPROC_PER_NODE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node_rank in (0, 1)
    ]
    outputs = []
    try:
        for launcher in launchers:
            stdout, stderr = launcher.communicate(timeout=180)
            assert launcher.returncode == 0, stderr[-3000:]
            outputs.append(stdout)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    # torchrun assigns global ranks by node rank; each node has one local rank 0.
    assert _probes(outputs[0]) == [(0, 2, 0, "127.0.0.1", port, 3.0, ARGS)]
    assert _probes(outputs[1]) == [(1, 2, 0, "127.0.0.1", port, 3.0, ARGS)]


def test_bad_topology_is_rejected_before_launch() -> None:
    result = subprocess.run(
        ["bash", str(LAUNCHER)],
        env=_launcher_env(NNODES="2", NODE_RANK="2", NPROC_PER_NODE="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "0 <= NODE_RANK < NNODES" in result.stderr
    assert "NNODES=2 NODE_RANK=2" in result.stderr
    result = subprocess.run(
        ["bash", str(LAUNCHER)],
        env=_launcher_env(NPROC_PER_NODE="two"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "NPROC_PER_NODE=two must be a non-negative integer" in result.stderr
