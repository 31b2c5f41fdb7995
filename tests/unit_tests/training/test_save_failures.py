"""A save that does not fit on its disk (a small tmpfs that holds one checkpoint), in every
checkpoint format at 1 and 2 ranks: every rank stops at the same iteration with one line that
says first that no space is left (path, MiB needed, MiB free), nothing of it is written, and the
previous checkpoint is still the one that loads."""

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
    ("engine", "nproc"),
    [
        ([], 1),
        ([], 2),
        (["--ckpt-format", "torch_dist"], 2),
        (["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], 1),
        (["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], 2),
        (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--async-save"], 2),
    ],
    ids=["torch-1", "torch-2", "torch_dist-2", "fsdp-1", "fsdp-2", "fsdp-async-2"],
)
def test_full_disk_during_a_save_stops_every_rank_and_keeps_the_previous(small_disk, engine, nproc):
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
    status, stdout, stderr = run_torchrun(argv, nproc=nproc, cwd=REPO, timeout_s=180)
    assert status == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    ranks = sorted(line.split(":")[1] for line in errors)
    assert ranks == [f" rank {rank}" for rank in range(nproc)], stderr[-3000:]
    # Said first, on every rank: no space, the path, what the save needs and what is free.
    pattern = rf"error: rank \d: no space left on device: {re.escape(str(save))} needs about "
    pattern += r"(\d+\.\d\d) MiB, (\d+\.\d\d) MiB free; "
    for line in errors:
        found = re.match(pattern, line)
        assert found, line
        needed, free = float(found.group(1)), float(found.group(2))
        # One checkpoint of TINY_GPT is 1.65 MB (torch) / 1.83 MB (torch_dist) on disk.
        assert 1.5 < needed < 2.0 and free < needed, line
        assert "nothing of iteration 2 was written and iteration 1 stays the checkpoint" in line
    # The ranks print no traceback (torchrun's own failure report follows theirs).
    assert "Traceback" not in stderr.split("failed (exitcode")[0]
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
