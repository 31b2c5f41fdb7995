"""Training-loop numbers: data-parallel and accumulation invariance, NaN skipping, log lines."""

import math
import os
import re

import pytest
import torch

from tests.launch import run_torchrun
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
TEN = ["--train-iters", "10"]
TORCHRUN_TIMEOUT_S = 120


def assert_losses_close(actual: dict, expected: dict, rtol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for iteration, loss in expected.items():
        assert abs(actual[iteration] - loss) <= rtol * abs(loss), (iteration, actual, expected)


def test_loss_decreases_and_is_deterministic():
    first = run_pretrain(TINY_GPT + ["--train-iters", "20"])
    second = run_pretrain(TINY_GPT + ["--train-iters", "20"])
    assert first.losses == second.losses
    assert first.losses[20] < first.losses[1] - 0.2
    assert math.log(512) - 0.2 < first.losses[1] < math.log(512) + 0.3  # ~uniform at init


def test_gradient_accumulation_matches_one_big_micro_batch():
    accumulate = run_pretrain(TINY_GPT + TEN + NO_DROPOUT)  # 4 micro-batches of 2
    single = run_pretrain(TINY_GPT + TEN + NO_DROPOUT + ["--micro-batch-size", "8"])
    assert_losses_close(accumulate.losses, single.losses, rtol=1e-5)


def test_two_ranks_match_one_process():
    single = run_pretrain(TINY_GPT + TEN + NO_DROPOUT)
    per_rank = run_distributed(run_pretrain_on_rank, 2, TINY_GPT + TEN + NO_DROPOUT)
    for losses in per_rank:
        assert_losses_close(losses, single.losses, rtol=1e-5)


def test_torchrun_two_processes_match_single_process():
    """Issue acceptance: `torchrun --nproc-per-node 2 pretrain_gpt.py ...` on CPU."""
    argv = TINY_GPT + ["--train-iters", "6"] + NO_DROPOUT
    single = run_pretrain(argv)
    status, stdout, stderr = run_torchrun(
        ["pretrain_gpt.py", *argv], nproc=2, cwd=REPO, timeout_s=TORCHRUN_TIMEOUT_S
    )
    if status is None:
        raise AssertionError(
            f"torchrun ran past {TORCHRUN_TIMEOUT_S} s (about 5 s when healthy). stdout tail:\n"
            f"{stdout[-3000:]}\nstderr tail (stacks of the stuck ranks):\n{stderr[-12000:]}"
        )
    assert status == 0, stderr[-3000:]
    logged = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", stdout)]
    assert len(logged) == 6
    for iteration, loss in enumerate(logged, start=1):
        # the log prints 7 significant digits
        assert abs(loss - single.losses[iteration]) <= 1e-5 * single.losses[iteration] + 5e-6


def test_nan_loss_skips_the_step(monkeypatch):
    """A NaN loss at iteration 3 is skipped and counted; the weights are not touched."""
    from megatron.training import training

    real = training.forward_backward
    calls = {"n": 0}
    snapshot = {}

    def poisoned(run, batch, **options):
        calls["n"] += 1
        if calls["n"] == 2 * 4 + 1:  # first micro-batch of iteration 3 (4 micro-batches/step)
            snapshot.update({k: v.detach().clone() for k, v in run.module.state_dict().items()})
            batch = dict(batch, loss_mask=batch["loss_mask"] * float("nan"))
        return real(run, batch, **options)

    monkeypatch.setattr(training, "forward_backward", poisoned)
    seen = {}
    real_step = training.train_step

    def spy_step(config, *, env, run, dataset, state, **rest):
        out = real_step(config, env=env, run=run, dataset=dataset, state=state, **rest)
        if state.iteration == 2:  # the step that completes iteration 3
            seen.update({k: v.detach().clone() for k, v in run.module.state_dict().items()})
        return out

    monkeypatch.setattr(training, "train_step", spy_step)
    result = run_pretrain(TINY_GPT + ["--train-iters", "5", "--no-check-for-nan-in-loss-and-grad"])
    assert math.isnan(result.losses[3])
    assert result.state.skipped_iterations == 1 and result.state.nan_iterations == 1
    assert all(torch.equal(seen[k], snapshot[k]) for k in snapshot)
    assert all(math.isfinite(result.losses[i]) for i in (1, 2, 4, 5))


def test_skipped_iteration_is_left_out_of_the_interval(monkeypatch, capsys):
    """As Megatron-LM logs it: the interval's lm loss averages the iterations that updated the
    weights, and the skipped / NaN counters count within the interval only."""
    from megatron.training import training

    real = training.forward_backward
    calls = {"n": 0}

    def poisoned(run, batch, **options):
        calls["n"] += 1
        if calls["n"] == 2 * 4 + 1:  # iteration 3
            batch = dict(batch, loss_mask=batch["loss_mask"] * float("nan"))
        return real(run, batch, **options)

    monkeypatch.setattr(training, "forward_backward", poisoned)
    result = run_pretrain(
        TINY_GPT
        + ["--train-iters", "10", "--log-interval", "5", "--no-check-for-nan-in-loss-and-grad"]
    )
    lines = [LINE.match(line) for line in capsys.readouterr().out.splitlines()]
    lines = {int(m["it"]): m for m in lines if m}
    assert sorted(lines) == [5, 10]
    assert (int(lines[5]["skipped"]), int(lines[5]["nans"])) == (1, 1)
    assert (int(lines[10]["skipped"]), int(lines[10]["nans"])) == (0, 0)
    first = sum(result.losses[i] for i in (1, 2, 4, 5)) / 4
    second = sum(result.losses[i] for i in range(6, 11)) / 5
    assert float(lines[5]["loss"]) == pytest.approx(first, rel=1e-6)
    assert float(lines[10]["loss"]) == pytest.approx(second, rel=1e-6)
    assert result.state.skipped_iterations == 1 and result.state.nan_iterations == 1


LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(?P<it>\d+)/ +(?P<total>\d+) \|"
    r" consumed samples: +(?P<samples>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>[0-9.]+) \|"
    r" throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>[0-9.]+) \|"
    r" tokens per GPU \(tokens/s/GPU\): (?P<tokens>[0-9.]+) \|"
    r" learning rate: (?P<lr>[0-9.E+-]+) \|"
    r" global batch size: +(?P<gbs>\d+) \|"
    r" lm loss: (?P<loss>[0-9.E+-]+) \|"
    r" loss scale: 1.0 \|"
    r" grad norm: (?P<gnorm>[0-9.]+) \|"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nans>\d+) \|"
    r" mem allocated \(GiB\): (?P<mem>[0-9.]+) \|$"
)


def test_log_line_fields(capsys):
    argv = TINY_GPT + ["--train-iters", "4", "--log-interval", "2", "--lr-warmup-iters", "2"]
    argv += ["--eval-interval", "2", "--eval-iters", "1", "--split", "90,10,0"]
    result = run_pretrain(argv)
    out = capsys.readouterr().out
    lines = [LINE.match(line) for line in out.splitlines() if " iteration " in line]
    lines = [match for match in lines if match]
    assert [int(m["it"]) for m in lines] == [2, 4]
    assert [int(m["samples"]) for m in lines] == [16, 32]
    assert all(int(m["gbs"]) == 8 and int(m["total"]) == 4 for m in lines)
    # lr of the update that completed the logged iteration: warmup 2 -> 1e-3; then linear
    # decay from iteration 2 to 4: iteration 4 is at the end, lr 0.
    assert [float(m["lr"]) for m in lines] == [1e-3, 0.0]
    mean = (result.losses[3] + result.losses[4]) / 2
    assert float(lines[1]["loss"]) == pytest.approx(mean, rel=1e-6)
    tokens = float(lines[1]["tokens"])
    ms = float(lines[1]["ms"])
    assert tokens == pytest.approx(8 * 32 / (ms / 1000), rel=0.01)
    valid = re.findall(
        r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|"
        r" lm loss PPL: (\S+) \|",
        out,
    )
    assert [int(v[0]) for v in valid] == [2, 4]
    for _, loss, ppl in valid:
        assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_sigterm_with_exit_signal_handler_saves_and_resumes(tmp_path):
    """--exit-signal-handler: SIGTERM mid-run (what Slurm's --signal sends before the time
    limit) ends the iteration, saves it and exits 0; the run resumes from that iteration."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from megatron.training.checkpoint import read_tracker
    from tests.unit_tests.training.common import TINY_GPT, run_pretrain

    schedule = ["--lr-decay-iters", "1000"]
    argv = [
        sys.executable,
        "-u",
        "pretrain_gpt.py",
        *TINY_GPT,
        *schedule,
        "--train-iters",
        "100000",
        "--save",
        str(tmp_path),
        "--exit-signal-handler",
    ]
    repo_root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        argv, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            logged = re.search(r"iteration\s+(\d+)/", line)
            if logged and int(logged.group(1)) >= 3:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    saved = read_tracker(str(tmp_path))
    assert saved is not None and 3 <= saved < 100000
    assert f"exiting at iteration {saved} (SIGTERM received)" in output
    resumed = run_pretrain(
        TINY_GPT + schedule + ["--train-iters", str(saved + 2), "--load", str(tmp_path)]
    )
    assert sorted(resumed.losses) == [saved + 1, saved + 2]


def test_sigterm_handler_is_installed_only_for_the_run():
    import signal

    from megatron.training.run_hooks import ExitSignal

    before = signal.getsignal(signal.SIGTERM)
    with ExitSignal(True) as handler:
        assert signal.getsignal(signal.SIGTERM) == handler._handle
        signal.raise_signal(signal.SIGTERM)
        assert handler.received
    assert signal.getsignal(signal.SIGTERM) == before
    with ExitSignal(False):
        assert signal.getsignal(signal.SIGTERM) == before


def _exit_reasons_when_only_rank_1_got_sigterm(rank, world_size):
    import argparse

    from megatron.training.run_hooks import ExitSignal, exit_reason

    args = argparse.Namespace(exit_interval=None, exit_duration_in_mins=None)

    class Env:
        device = torch.device("cpu")
        dp_group = torch.distributed.group.WORLD
        all_ranks_group = torch.distributed.group.WORLD

    handler = ExitSignal(True)
    before = exit_reason(args, env=Env(), start=0.0, iteration=1, exit_signal=handler)
    handler.received = rank == 1
    return before, exit_reason(args, env=Env(), start=0.0, iteration=2, exit_signal=handler)


def test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_iteration():
    from tests.unit_tests.dist_utils import run_distributed

    reasons = run_distributed(_exit_reasons_when_only_rank_1_got_sigterm, 2)
    assert reasons == [("", "SIGTERM received"), ("", "SIGTERM received")]


def test_backward_runs_without_the_device_worker_threads_unless_asked(monkeypatch):
    """forward_backward turns the autograd engine's worker threads off for its backward
    (--backward-worker-threads keeps them), as seen from inside each backward pass, and
    restores the setting afterwards; the two modes train the same."""
    seen = []
    real_backward = torch.Tensor.backward

    def observed_backward(self, *args, **kwargs):
        # A hook on the root runs inside the engine, while this backward pass runs.
        self.register_hook(lambda grad: seen.append(torch._C._is_multithreading_enabled()))
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", observed_backward)
    argv = TINY_GPT + ["--train-iters", "2"]
    assert torch._C._is_multithreading_enabled()
    calling_thread = run_pretrain(argv)
    assert seen == [False] * 8  # 2 iterations x 4 micro-batches
    assert torch._C._is_multithreading_enabled()
    seen.clear()
    worker_threads = run_pretrain(argv + ["--backward-worker-threads"])
    assert seen == [True] * 8
    assert torch._C._is_multithreading_enabled()
    assert worker_threads.losses == calling_thread.losses
    assert sorted(calling_thread.losses) == [1, 2]


def test_nan_loss_stops_the_run_by_default(monkeypatch, tmp_path):
    """--check-for-nan-in-loss-and-grad (on by default, as in Megatron-LM): a NaN loss at
    iteration 3 stops the run there, and the last checkpoint stays iteration 2's."""
    from megatron.training import training

    real = training.forward_backward
    calls = {"n": 0}

    def poisoned(run, batch, **options):
        calls["n"] += 1
        if calls["n"] == 2 * 4 + 1:  # first micro-batch of iteration 3
            batch = dict(batch, loss_mask=batch["loss_mask"] * float("nan"))
        return real(run, batch, **options)

    monkeypatch.setattr(training, "forward_backward", poisoned)
    save = tmp_path / "ckpt"
    argv = TINY_GPT + ["--train-iters", "5", "--save", str(save), "--save-interval", "1"]
    with pytest.raises(training.NonFiniteTrainingError, match=r"^iteration 3: lm loss nan "):
        run_pretrain(argv)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(path.name for path in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]


def test_diverging_run_exits_1_with_one_error_line():
    """The issue's case: --lr 1e6 turns the loss NaN; the run stops with one line, status 1."""
    import subprocess
    import sys

    argv = [sys.executable, "pretrain_gpt.py", *TINY_GPT, "--train-iters", "20", "--lr", "1e6"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: iteration "), done.stderr
    assert "--no-check-for-nan-in-loss-and-grad" in lines[0]
    logged = re.findall(r"iteration +(\d+)/", done.stdout)
    stopped_at = int(lines[0].split("iteration ")[1].split(":")[0])
    assert len(logged) == stopped_at - 1  # every finished iteration logged, none after


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "20"]


@pytest.mark.slow
def test_dropout_losses_do_not_depend_on_the_data_parallel_size():
    """Dropout masks come from each micro-batch's first global sample, not from the rank."""
    single = run_pretrain(TINY_GPT + DROPOUT).losses
    plain = run_pretrain(TINY_GPT + NO_DROPOUT + DROPOUT[-2:]).losses  # the masks matter
    assert max(abs(single[i] - plain[i]) / plain[i] for i in single) > 1e-3
    for world_size in (2, 4):
        per_rank = run_distributed(run_pretrain_on_rank, world_size, TINY_GPT + DROPOUT)
        for losses in per_rank:
            assert_losses_close(losses, single, rtol=1e-5)


@pytest.mark.slow
def test_dropout_run_saved_at_dp2_resumes_at_dp1_exactly(tmp_path):
    root = str(tmp_path / "ckpt")
    uninterrupted = run_pretrain(TINY_GPT + DROPOUT).losses
    first = TINY_GPT + DROPOUT + ["--save", root, "--exit-interval", "10"]
    run_distributed(run_pretrain_on_rank, 2, first)
    resumed = run_pretrain(TINY_GPT + DROPOUT + ["--load", root]).losses
    assert sorted(resumed) == list(range(11, 21))
    assert_losses_close(resumed, {i: uninterrupted[i] for i in range(11, 21)}, rtol=1e-5)
