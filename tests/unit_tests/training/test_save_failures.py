"""A save that fails part-way (a full disk, here a small tmpfs that holds one checkpoint): every
rank stops at the same iteration with one line naming the path and the iteration, the partial
.tmp is gone, and the previous checkpoint is still the one that loads."""

from __future__ import annotations

import os
import re
import subprocess
import uuid

import pytest

from tests.launch import run_torchrun
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
# One checkpoint of TINY_GPT is 1.65 MB (torch) / 1.83 MB (torch_dist): 2600 KiB holds one.
TMPFS_SIZE = "2600k"


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize(
    "engine",
    [
        [],
        ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"],
        ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--async-save"],
    ],
    ids=["ddp", "fsdp", "fsdp-async"],
)
def test_full_disk_during_a_save_stops_every_rank_and_keeps_the_previous(small_disk, engine):
    save = small_disk / "ckpt"
    argv = [
        "pretrain_gpt.py",
        *TINY_GPT,
        *NO_DROPOUT,
        *engine,
        "--train-iters",
        "4",
        "--save",
        str(save),
        "--save-interval",
        "1",
    ]
    status, stdout, stderr = run_torchrun(argv, nproc=2, cwd=REPO, timeout_s=180)
    assert status == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert sorted(line.split(":")[1] for line in errors) == [" rank 0", " rank 1"], stderr[-3000:]
    for line in errors:
        assert f"saving iteration 2 to {save / 'iter_0000002'} failed on rank " in line
        assert "iteration 1 stays the checkpoint --load uses" in line
        assert "the partial iter_0000002.tmp was removed" in line
    # The ranks print no traceback (torchrun's own failure report follows theirs).
    assert "Traceback" not in stderr.split("failed (exitcode")[0]
    # The failing rank names the cause: the free space left on that disk.
    causes = [re.search(r"\(([^)]*MiB free on the disk of [^)]*)\)", line) for line in errors]
    free = [float(m.group(1).split(" MiB free")[0].split("; ")[-1]) for m in causes if m]
    assert free and all(value < 1.0 for value in free), errors
    # Nothing half-written is left, and the first checkpoint is published and tracked.
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    if "--async-save" not in engine:  # async: published while iteration 2 already runs
        assert "iteration        2/" not in stdout.split(" > saved checkpoint at iteration 1")[0]
    engine = [flag for flag in engine if flag != "--async-save"]  # the resume saves nothing
    # It loads (in one process: torch_dist reshards) and training continues from iteration 1.
    resumed = run_pretrain(
        TINY_GPT + NO_DROPOUT + engine + ["--train-iters", "4", "--load", str(save)]
    )
    assert sorted(resumed.losses) == [2, 3, 4]
