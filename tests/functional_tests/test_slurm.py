"""scripts/slurm/pretrain_gpt.sbatch on a real Slurm cluster (brought up by
scripts/slurm/ci_setup_slurm.sh): a rendezvous probe and a 2-task CPU training run.

Skips with the reason when sbatch is missing or no node is idle.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO_ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
PROBE = Path(__file__).resolve().parent / "rendezvous_probe.py"
PROBE_LINE = re.compile(
    r"^probe rank=(\d+) world=(\d+) local_rank=(\d+) master=(\S+):(\d+) sum=(\S+) argv=(.*)$"
)
TINY_GPT_ARGS = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 10 --log-interval 1 --lr 1e-3"
).split()


def _cluster_skip_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH: run `bash scripts/slurm/ci_setup_slurm.sh` as root first"
    result = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, check=False
    )
    states = result.stdout.split()
    if result.returncode != 0 or not {"idle", "mixed"} & set(states):
        return (
            f"no idle Slurm node (sinfo rc={result.returncode}, states={states}, "
            f"stderr={result.stderr.strip()!r}): run `bash scripts/slurm/ci_setup_slurm.sh`"
        )
    return None


pytestmark = pytest.mark.skipif(
    _cluster_skip_reason() is not None, reason=str(_cluster_skip_reason())
)


def _submit(
    tmp_path: Path, args: list[str], *, env_extra: dict[str, str], timeout_s: int
) -> tuple[int, str, str]:
    """sbatch --wait -N1 -n2 the script; returns (sbatch exit status, job id, job log)."""
    log_path = tmp_path / "job-%j.out"
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    command = ["sbatch", "--wait", "--parsable", "-N1", "-n2", "--time=10", f"-o{log_path}"]
    result = subprocess.run(
        [*command, str(SBATCH_SCRIPT), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    job_id = result.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch printed no job id: {result.stdout!r} {result.stderr!r}"
    job_log = Path(str(log_path).replace("%j", job_id)).read_text()
    return result.returncode, job_id, job_log


def _job_exit_code(job_id: str) -> str:
    """ExitCode=<status>:<signal> from `scontrol show job` (no accounting database in CI)."""
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"\bExitCode=(\d+:\d+)", shown)
    assert match, f"no ExitCode in scontrol output: {shown}"
    return match.group(1)


def test_sbatch_rendezvous_sets_ranks_and_passes_arguments(tmp_path: Path) -> None:
    args = ["--flag", "value with spaces", "--lr", "1e-3"]
    status, job_id, job_log = _submit(
        tmp_path, args, env_extra={"MEGATRON_ENTRY": str(PROBE)}, timeout_s=180
    )
    assert status == 0, job_log
    assert _job_exit_code(job_id) == "0:0"
    probes = [PROBE_LINE.match(line) for line in job_log.splitlines()]
    probes = sorted((match.groups() for match in probes if match), key=lambda g: int(g[0]))
    assert len(probes) == 2, job_log
    expected_master = subprocess.run(
        ["hostname", "-s"], capture_output=True, text=True, check=True
    ).stdout.strip()
    for rank, (rank_s, world, local_rank, master, port, total, argv) in enumerate(probes):
        assert (int(rank_s), int(world), int(local_rank)) == (rank, 2, rank)
        assert master == expected_master
        assert int(port) == 29500 + int(job_id) % 1000
        assert float(total) == 3.0  # all-reduce of rank + 1 over ranks 0 and 1
        assert argv == '["--flag", "value with spaces", "--lr", "1e-3"]'


@pytest.mark.slow
@pytest.mark.skipif(
    not (REPO_ROOT / "pretrain_gpt.py").exists(), reason="pretrain_gpt.py is not written yet"
)
def test_sbatch_trains_tiny_gpt_on_two_cpu_tasks(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from tools.plot_losses import parse_log_lines

    status, job_id, job_log = _submit(tmp_path, TINY_GPT_ARGS, env_extra={}, timeout_s=600)
    assert status == 0, job_log[-4000:]
    assert _job_exit_code(job_id) == "0:0"
    run = parse_log_lines(job_log.splitlines(), source=f"slurm job {job_id}")
    assert run.iterations == list(range(1, 11)), job_log[-4000:]
    losses = run.series["lm loss"]
    assert len(losses) == 10
    # Mock data is uniform over 512 tokens: the first loss is near ln(512) = 6.24 and ten steps
    # at lr 1e-3 must not make it worse.
    assert 5.5 < losses[0] < 7.0
    assert losses[-1] < losses[0]
    assert run.recipe == "none" and run.settings["params-dtype"] == "float32"  # fp32, no FP8
    assert run.data_parallel_size == 2
