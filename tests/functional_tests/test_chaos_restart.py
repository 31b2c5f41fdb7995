"""Chaos test (issue 23, acceptance 3): ranks SIGKILLed at three moments drawn from a seeded RNG
under `torchrun --max-restarts 5` with `--save X --load X`; torchrun restarts the group, which
resumes from the last complete checkpoint by itself, and the run ends with exactly the losses
and the final weights of an uninterrupted run.

The kills come from inside the worker at planned moments (chaos_worker.py says why), one in a
training step and two during saves: one leaving a half-written iter_XXXXXXX.tmp, one after the
new directory was published but before the tracker named it. The resume points are asserted
too: a half-written or untracked checkpoint must never be the one loaded.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from tests.launch import end_session_with_stacks, free_port, start_session
from tools.plot_losses import parse_log_lines

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHAOS_WORKER = os.path.join(os.path.dirname(__file__), "chaos_worker.py")
CHAOS_SEED = 23
TRAIN_ITERS = 60
SAVE_INTERVAL = 5
RUN_TIMEOUT_S = 420  # a hang shows the ranks' stacks; a passing run takes 1-2 minutes
MODEL_FLAGS = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "256",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--lr",
    "0.001",
    "--min-lr",
    "0.0001",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--seed",
    "1234",
]
CHAOS_FLAGS = [
    *MODEL_FLAGS,
    "--train-iters",
    str(TRAIN_ITERS),
    "--save-interval",
    str(SAVE_INTERVAL),
]
LOADED = re.compile(r" > loaded checkpoint \S+ \(iteration (\d+)\)")
CHAOS_LINE = re.compile(
    r"^chaos: SIGKILL to rank (\d) in attempt (\d) at iteration (\d+) \(([a-z-]+)\)$"
)


def draw_kills(seed: int) -> list[dict]:
    """Three kills, one per attempt, at increasing iterations (each attempt resumes before its
    kill, so every kill happens): the moments in a seeded order, iterations and ranks drawn."""
    rng = random.Random(seed)
    moments = ["after-backward", "save-partial", "save-published"]
    rng.shuffle(moments)
    # The first window starts past the first save, so every restart loads a checkpoint.
    windows = [(SAVE_INTERVAL + 1, 20), (21, 40), (41, TRAIN_ITERS - SAVE_INTERVAL)]
    kills = []
    for attempt, (moment, (low, high)) in enumerate(zip(moments, windows)):
        if moment == "after-backward":
            iteration = rng.randint(low, high)
        else:
            saves = range(-(-low // SAVE_INTERVAL) * SAVE_INTERVAL, high + 1, SAVE_INTERVAL)
            iteration = rng.choice(saves)
        # Only rank 0 publishes a checkpoint and writes the tracker.
        rank = 0 if moment == "save-published" else rng.randint(0, 1)
        kills.append({"attempt": attempt, "rank": rank, "iteration": iteration, "moment": moment})
    return kills


def expected_resume(kill: dict) -> int:
    """The iteration the restarted group must load: the last checkpoint that was complete and
    named by the tracker when the rank died."""
    if kill["moment"] == "after-backward":  # iteration k-1 finished, with its save if any
        return (kill["iteration"] - 1) // SAVE_INTERVAL * SAVE_INTERVAL
    return kill["iteration"] - SAVE_INTERVAL  # the save of k was cut short or never tracked


def _torchrun(
    script: str, flags: list[str], *, plan: list[dict], rendezvous: str = "c10d"
) -> tuple[int, str, str]:
    """torchrun --max-restarts 5 on 2 ranks, with c10d rendezvous or the static one (torchrun's
    default, --master-port): both keep one store for the whole job."""
    endpoint = {
        "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"],
        "static": ["--master-addr", "127.0.0.1", "--master-port", str(free_port())],
    }[rendezvous]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "5",
        *endpoint,
        script,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["MEGATRON_CHAOS_PLAN"] = json.dumps(plan)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: the shared store
    process = start_session(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        end_session_with_stacks(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"{script} passed {RUN_TIMEOUT_S} s; stacks:\n{stderr[-20000:]}")
    return process.returncode, stdout, stderr


def _final_state(save_dir: str) -> dict[str, torch.Tensor]:
    directory = os.path.join(save_dir, f"iter_{TRAIN_ITERS:07d}")
    tensors = torch.load(os.path.join(directory, "model.pt"), weights_only=True)
    optimizer = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
    return {"model": tensors, "optimizer": optimizer}


def _assert_same_tree(chaos, reference, path: str = "") -> None:
    if isinstance(reference, dict):
        assert chaos.keys() == reference.keys(), path
        for key in reference:
            _assert_same_tree(chaos[key], reference[key], f"{path}/{key}")
    elif isinstance(reference, (list, tuple)):
        assert len(chaos) == len(reference), path
        for index, (left, right) in enumerate(zip(chaos, reference)):
            _assert_same_tree(left, right, f"{path}/{index}")
    elif isinstance(reference, torch.Tensor):  # bitwise: the bytes, not the values
        assert chaos.dtype == reference.dtype and chaos.shape == reference.shape, path
        as_bytes = [t.contiguous().view(-1).view(torch.uint8) for t in (chaos, reference)]
        assert torch.equal(*as_bytes), f"{path} differs"
    else:
        assert chaos == reference, path


def test_draw_kills_covers_a_step_and_both_save_moments():
    kills = draw_kills(CHAOS_SEED)
    assert sorted(kill["moment"] for kill in kills) == [
        "after-backward",
        "save-partial",
        "save-published",
    ]
    iterations = [kill["iteration"] for kill in kills]
    assert iterations == sorted(set(iterations)) and iterations[0] > SAVE_INTERVAL
    resumes = [expected_resume(kill) for kill in kills]
    # Each attempt resumes before the next kill's iteration, so every planned kill happens.
    assert all(resume < later for resume, later in zip(resumes[1:], iterations[1:]))
    assert all(resume < kill for resume, kill in zip(resumes, iterations))


@pytest.mark.slow
def test_killed_ranks_restart_and_match_an_uninterrupted_run(tmp_path):
    kills = draw_kills(CHAOS_SEED)
    pretrain = os.path.join(REPO_ROOT, "pretrain_gpt.py")
    reference_dir, chaos_dir = str(tmp_path / "reference"), str(tmp_path / "chaos")
    status, reference_out, reference_err = _torchrun(
        pretrain, [*CHAOS_FLAGS, "--save", reference_dir, "--load", reference_dir], plan=[]
    )
    assert status == 0, reference_err[-4000:]
    status, chaos_out, chaos_err = _torchrun(
        CHAOS_WORKER, [*CHAOS_FLAGS, "--save", chaos_dir, "--load", chaos_dir], plan=kills
    )
    assert status == 0, chaos_err[-6000:]

    done = [match.groups() for line in chaos_err.splitlines() if (match := CHAOS_LINE.match(line))]
    assert done == [
        (str(k["rank"]), str(k["attempt"]), str(k["iteration"]), k["moment"]) for k in kills
    ]
    # 4 attempts: the first trained from scratch, each restart loaded the last complete save.
    assert chaos_out.count(" > megatron-fp8 run:") == 4
    loaded = [int(match.group(1)) for match in LOADED.finditer(chaos_out)]
    assert loaded == [expected_resume(kill) for kill in kills]

    # Every iteration's last logged loss and grad norm equal the uninterrupted run's.
    reference = parse_log_lines(reference_out.splitlines(), source="reference")
    chaos = parse_log_lines(chaos_out.splitlines(), source="chaos")
    assert reference.iterations == chaos.iterations == list(range(1, TRAIN_ITERS + 1))
    for metric in ("lm loss", "grad-norm", "learning-rate", "consumed-samples"):
        assert chaos.series[metric] == reference.series[metric], metric

    # What is left on disk: every save complete, nothing half-written, the tracker at the end,
    # and the final weights and optimizer state bitwise those of the uninterrupted run.
    names = sorted(os.listdir(tmp_path / "chaos"))
    saved = [f"iter_{it:07d}" for it in range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL)]
    assert names == [*saved, "latest_checkpointed_iteration.txt"]
    tracker = (tmp_path / "chaos" / "latest_checkpointed_iteration.txt").read_text()
    assert tracker.strip() == str(TRAIN_ITERS)
    _assert_same_tree(
        _final_state(str(tmp_path / "chaos")), _final_state(str(tmp_path / "reference"))
    )


@pytest.mark.slow
def test_a_restarted_group_meets_again_under_static_rendezvous():
    """torchrun's default (static) rendezvous, no checkpoints: rank 1 dies in iteration 2 and
    the restarted group trains from scratch to the end. Before each group agreed on a store
    namespace of its own, the restarted ranks read the dead group's gloo addresses from the
    job's store and failed to connect (or waited on its stale keys until the timeout)."""
    flags = [*MODEL_FLAGS, "--train-iters", "3"]
    kill = {"attempt": 0, "rank": 1, "iteration": 2, "moment": "after-backward"}
    status, stdout, stderr = _torchrun(CHAOS_WORKER, flags, plan=[kill], rendezvous="static")
    assert status == 0, stderr[-6000:]
    assert [line for line in stderr.splitlines() if CHAOS_LINE.match(line)] == [
        "chaos: SIGKILL to rank 1 in attempt 0 at iteration 2 (after-backward)"
    ]
    assert stdout.count(" > megatron-fp8 run:") == 2
    assert "connectFullMesh" not in stderr
    run = parse_log_lines(stdout.splitlines(), source="static")
    assert run.iterations == [1, 2, 3]
