"""Sharded checkpoints on DTensor with --async-save (issue 21, acceptance 3-5).

A run at DP=2 (ZeRO-3, and FP8 parameters) saves asynchronously; resumed at DP=1 and DP=4 from
its iteration-3 checkpoint, the next 10 losses equal the uninterrupted run's. A rank killed
while an asynchronous save is being written leaves the previous checkpoint as the one that
loads, with nothing to clean up by hand. DDP writes and reads the same sharded layout."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import end_session_with_stacks, free_port, start_session
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)
from tests.unit_tests.training.common import ZERO3_DTENSOR as ZERO3

REPO = pathlib.Path(__file__).resolve().parents[3]
HELD_SAVE_DRIVER = pathlib.Path(__file__).with_name("held_save_driver.py")
SAVE_AT, TOTAL = 3, 13
FP8_PARAMS = ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]
FP64_GRADS = ["--main-grads-dtype", "fp64"]


@pytest.mark.parametrize(
    "precision",
    [[], FP8_PARAMS, FP8_PARAMS + FP64_GRADS],
    ids=["bf16", "fp8-params", "fp8-params-fp64-grads"],
)
def test_async_save_at_dp2_resumes_at_dp1_and_dp4(tmp_path, precision):
    base = TINY_GPT + NO_DROPOUT + ZERO3 + precision + ["--train-iters", str(TOTAL)]
    save = tmp_path / "ckpt"
    uninterrupted = run_distributed(
        run_pretrain_on_rank,
        2,
        base + ["--save", str(save), "--save-interval", str(SAVE_AT), "--async-save"],
    )[0]
    # Every save was published (the last one before the run returned), none left half-done.
    assert sorted(os.listdir(save)) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000009",
        "iter_0000012",
        "iter_0000013",
        "latest_checkpointed_iteration.txt",
    ]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == f"{TOTAL}\n"
    resume = base + ["--load", str(save), "--ckpt-step", str(SAVE_AT)]
    resumed_at = {ws: run_distributed(run_pretrain_on_rank, ws, resume)[0] for ws in (1, 4)}
    for world_size, resumed in resumed_at.items():
        assert sorted(resumed) == list(range(SAVE_AT + 1, TOTAL + 1))
        # FP8 parameters only: reductions summed in another order at another DP size move a
        # weight across an FP8 rounding boundary now and then, and the loss with it: every
        # step after the checkpoint stays within twice what the same DP size drifts from DP=2
        # when trained from scratch (the control). Measured (session 47, Megatron-LM's
        # schedule): the DP=4 resume is 1.0e-4 off at step 6 and 2.8e-4 at most, its control
        # 4.8e-4; the DP=1 resume within 5e-7 to step 12, 3.2e-5 at 13. (On the schedule one
        # step ahead the DP=4 resume happened to stay within 1e-6 for 5 steps.) The resume at
        # DP=2 below is exact.
        # With fp64 grad buffers (accumulated, reduced and normed in fp64, rounded to fp32
        # once) every DP size computes the same update: all 10 within 1e-6 (measured: 8e-8 at
        # most, the order in which the logged loss is averaged).
        exact_steps = 0 if precision == FP8_PARAMS else 10
        later = 1e-5 * max(uninterrupted.values())
        if precision == FP8_PARAMS:
            scratch = run_distributed(run_pretrain_on_rank, world_size, base)[0]
            later = max(later, 2 * max(abs(scratch[i] - uninterrupted[i]) for i in scratch))
        for iteration, loss in resumed.items():
            bound = 1e-6 * loss if iteration <= SAVE_AT + exact_steps else later
            assert abs(loss - uninterrupted[iteration]) <= bound, (world_size, iteration)
    if precision:  # same DP size: nothing but the checkpoint differs, so bitwise equal
        resumed = run_distributed(run_pretrain_on_rank, 2, resume)[0]
        assert resumed == {i: uninterrupted[i] for i in range(SAVE_AT + 1, TOTAL + 1)}


def test_ddp_torch_dist_resumes_at_dp1_and_under_megatron_fsdp(tmp_path):
    """DDP's torch_dist checkpoint (replicated tensors, each written once) holds the same keys
    as Megatron-FSDP's: it resumes at another DP size and under the other engine."""
    base = TINY_GPT + NO_DROPOUT + ["--train-iters", "6"]
    save = tmp_path / "ckpt"
    uninterrupted = run_distributed(
        run_pretrain_on_rank,
        2,
        base + ["--ckpt-format", "torch_dist", "--save", str(save), "--save-interval", "3"],
    )[0]
    shards = sorted(path.name for path in (save / "iter_0000003" / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resume = base + ["--load", str(save), "--ckpt-step", "3"]
    for engine in (["--ckpt-format", "torch_dist"], ["--use-megatron-fsdp"]):
        resumed = run_pretrain(resume + engine).losses
        assert sorted(resumed) == [4, 5, 6]
        for iteration, loss in resumed.items():
            assert loss == pytest.approx(uninterrupted[iteration], rel=1e-6), (engine, iteration)


def _wait_for(paths: list[pathlib.Path], process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in paths):
        if process.poll() is not None or time.monotonic() > deadline:
            end_session_with_stacks(process)
            _, stderr = process.communicate()
            pytest.fail(f"the held save never started:\n{stderr[-3000:]}")
        time.sleep(0.2)


def test_rank_killed_during_async_save_resumes_from_previous_checkpoint(tmp_path, capsys):
    """The writers of iteration 4 stop for good after writing their shards (a fault injected
    by held_save_driver.py);
    rank 1 is then killed. The tracker still names iteration 2, the half-written .tmp is
    never read, and a plain resume (same --save) trains on and replaces it."""
    save = tmp_path / "ckpt"
    argv = (
        TINY_GPT
        + NO_DROPOUT
        + ZERO3
        + ["--train-iters", "6", "--save", str(save), "--save-interval", "2", "--async-save"]
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(HELD_SAVE_DRIVER),
        "4",
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = start_session(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    held = save / "iter_0000004.tmp"
    _wait_for([held / "held_by_rank_0", held / "held_by_rank_1"], process, timeout_s=300)
    os.kill(int((held / "held_by_rank_1").read_text()), signal.SIGKILL)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        end_session_with_stacks(process)
        pytest.fail("torchrun did not stop after a rank was killed")
    assert process.returncode != 0, stderr[-3000:]
    assert " > saved checkpoint at iteration 2 to " in stdout
    assert " > saved checkpoint at iteration 4" not in stdout
    # The killed save: shards written, no metadata.json, not published, not tracked.
    assert sorted(os.listdir(save)) == [
        "iter_0000002",
        "iter_0000004.tmp",
        "latest_checkpointed_iteration.txt",
    ]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert not (held / "metadata.json").exists()
    assert sorted(p.name for p in (held / "sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    logged = {
        int(i): float(v)
        for i, v in re.findall(
            r"iteration +(\d+)/ +6 \|.*? lm loss: "
            r"([0-9.E+-]+) \|",
            stdout,
        )
    }
    assert 3 in logged, stdout[-3000:]

    capsys.readouterr()
    resumed = run_pretrain(argv + ["--load", str(save)])  # one rank, nothing cleaned by hand
    out = capsys.readouterr().out
    assert f" > loaded checkpoint {save / 'iter_0000002'} (iteration 2)" in out
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    assert resumed.losses[3] == pytest.approx(logged[3], rel=1e-5)  # the log's 7 digits
    published = ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert sorted(os.listdir(save)) == [*published, "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6\n"


def test_no_sharded_tensor_and_no_silenced_deprecation_in_the_package():
    """Acceptance 5: the package neither uses ShardedTensor nor hides a deprecation warning."""
    offenders = []
    pattern = re.compile(
        r"ShardedTensor|sharded_tensor|torch\.distributed\._shard|"
        r"simplefilter\(\s*\"ignore\",\s*(FutureWarning|DeprecationWarning)|"
        r"filterwarnings\(\s*\"ignore\".*(FutureWarning|DeprecationWarning|deprecat)"
    )
    sources = sorted((REPO / "megatron").rglob("*.py")) + [REPO / "pretrain_gpt.py"]
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert len(sources) > 50
    assert offenders == []


def test_delayed_scaling_checkpoint_of_the_other_engine_is_refused(tmp_path):
    """DDP keeps the delayed-scaling state in a file, Megatron-FSDP in its shards: a resume
    under the other engine is refused by name; --finetune (weights only) loads."""
    from megatron.training.checkpoint import CheckpointError

    base = TINY_GPT + NO_DROPOUT + ["--fp8-recipe", "delayed", "--ckpt-format", "torch_dist"]
    run_pretrain(base + ["--train-iters", "2", "--save", str(tmp_path)])
    assert (tmp_path / "iter_0000002" / "fp8_delayed_scaling.pt").is_file()
    resume = base + ["--use-megatron-fsdp", "--train-iters", "3", "--load", str(tmp_path)]
    with pytest.raises(CheckpointError) as info:
        run_pretrain(resume)
    assert "a --fp8-recipe delayed checkpoint saved without --use-megatron-fsdp" in str(info.value)
    assert sorted(run_pretrain(resume + ["--finetune"]).losses) == [1, 2, 3]
