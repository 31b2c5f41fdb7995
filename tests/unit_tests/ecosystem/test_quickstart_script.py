"""scripts/quickstart.sh around a stand-in interpreter (no install, no training): the torch
thread default, one run directory per flag set, train.log as written by the run, and the run's
exit status."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

# Answers the calls quickstart.sh and setup_env.sh make: setup_env's two import checks, the
# data preparation (its last line is the prefix), and pretrain_gpt.py, whose arguments and
# thread setting it prints as a training run would print its log.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
  -c) exit 0 ;;
  -) cat > /dev/null; exit 0 ;;
  scripts/prepare_quickstart_data.py) echo "wrote 1 documents" >&2; echo /data/prefix; exit 0 ;;
  -u) shift; echo "OMP_NUM_THREADS=$OMP_NUM_THREADS argv: $*"; exit "${FAKE_RC:-0}" ;;
esac
exit 99
"""


def _quickstart(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    unset = ("OMP_NUM_THREADS", "RUN_NAME", "QUICKSTART_ITERS")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        ["bash", "scripts/quickstart.sh", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "PYTHON": str(fake), "OUTPUT_DIR": str(tmp_path / "runs"), **env},
    )


def test_default_run_gets_one_thread_its_directory_and_a_log(tmp_path: Path) -> None:
    proc = _quickstart(tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "default"
    log = (run_dir / "train.log").read_text()
    assert log.startswith("OMP_NUM_THREADS=1 argv: pretrain_gpt.py --data-path /data/prefix ")
    assert f"--save {run_dir}/checkpoints" in log
    assert log in proc.stdout  # the terminal sees what the log gets


def test_other_flags_get_another_directory_and_the_user_thread_count(tmp_path: Path) -> None:
    proc = _quickstart(tmp_path, "--fp8-recipe", "tensorwise", OMP_NUM_THREADS="3")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["fp8-recipe_tensorwise"]
    log = (tmp_path / "runs" / "fp8-recipe_tensorwise" / "train.log").read_text()
    assert log.startswith("OMP_NUM_THREADS=3 ")
    assert log.rstrip().endswith("--fp8-recipe tensorwise")
    assert "FP8 on CPU emulates its GEMMs" in proc.stdout  # slower: said up front
    named = _quickstart(tmp_path, "--train-iters", "50", RUN_NAME="short")
    assert named.returncode == 0, named.stderr
    assert (tmp_path / "runs" / "short" / "train.log").is_file()


def test_a_failed_run_fails_the_quickstart(tmp_path: Path) -> None:
    proc = _quickstart(tmp_path, FAKE_RC="3")
    assert proc.returncode == 3  # not hidden by the tee into train.log
    assert "quickstart: log" not in proc.stdout


def test_load_resumes_in_the_loaded_run_directory(tmp_path: Path) -> None:
    first = _quickstart(tmp_path, "--fp8-recipe", "tensorwise")
    run_dir = tmp_path / "runs" / "fp8-recipe_tensorwise"
    # The stand-in trains nothing, so no checkpoints/: the last line does not name one.
    assert first.stdout.rstrip().endswith(f"log {run_dir}/train.log (no checkpoint was saved)")
    (run_dir / "checkpoints").mkdir()
    load = ["--fp8-recipe", "tensorwise", "--load", f"{run_dir}/checkpoints"]
    resumed = _quickstart(tmp_path, *load, QUICKSTART_ITERS="40")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["fp8-recipe_tensorwise"]
    log = (run_dir / "train.log").read_text().splitlines()
    assert len(log) == 2  # appended, not overwritten
    assert f"--save {run_dir}/checkpoints" in log[1] and "--train-iters 40 " in log[1]
    assert "--lr-warmup-iters 4 " in log[1]
    assert log[1].endswith(f"--load {run_dir}/checkpoints")
    assert resumed.stdout.rstrip().endswith(
        f"(resume: bash scripts/quickstart.sh --fp8-recipe tensorwise --load {run_dir}/checkpoints)"
    )
    missing = _quickstart(tmp_path, "--load", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    expected = f"quickstart: error: --load {tmp_path}/nowhere: no such directory"
    assert missing.stderr.strip() == expected  # before any install or data preparation


def test_a_run_directory_with_a_checkpoint_is_not_trained_over(tmp_path: Path) -> None:
    """A plain rerun into a run directory that holds a checkpoint would replace its train.log
    and move its checkpoint tracker back: it exits 2 naming the three ways on, before any
    install or data preparation, and leaves the directory as it was."""
    run_dir = tmp_path / "runs" / "default"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("600")
    (run_dir / "train.log").write_text("600 iterations\n")
    proc = _quickstart(tmp_path, QUICKSTART_ITERS="20")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"quickstart: error: {run_dir} already holds a run (checkpoint of iteration 600): "
        f"resume it with bash scripts/quickstart.sh --load {run_dir}/checkpoints (past its "
        "end: add --train-iters N --use-checkpoint-opt_param-scheduler), start another with "
        f"RUN_NAME=<name>, or remove {run_dir}"
    )
    fp8_dir = tmp_path / "runs" / "fp8-recipe_tensorwise"
    (fp8_dir / "checkpoints").mkdir(parents=True)
    (fp8_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("40")
    fp8 = _quickstart(tmp_path, "--fp8-recipe", "tensorwise")  # the hint keeps the run's flags
    assert fp8.returncode == 2
    assert f"quickstart.sh --fp8-recipe tensorwise --load {fp8_dir}/checkpoints (" in fp8.stderr
    assert (run_dir / "train.log").read_text() == "600 iterations\n"
    other = _quickstart(tmp_path, QUICKSTART_ITERS="20", RUN_NAME="second")
    assert other.returncode == 0 and "20 iterations of about 0.5 s" in other.stdout
