"""The learning rate of every update and of every log line equals megatron-core's
OptimizerParamScheduler (0.16.1, in its own venv) stepped as Megatron-LM's training loop steps it:
the optimizer's update at iteration k, then `step(increment)`, then the log line reads the
group's lr. So update k uses the schedule at k - 1 (with warmup from 0, the first update is at
lr 0) and the lr logged at iteration k is the schedule at k."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron.core.optimizer import LRScheduleConfig
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from tests.unit_tests.ecosystem.test_mcore_interchange import _venv_python

ITERATIONS = 14
# megatron-core's loop: the update reads group["lr"]; then the scheduler steps; the log reads it.
MCORE_LOOP = """
import json, sys
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
case = json.loads(sys.argv[1])
class Optimizer:
    param_groups = [{"lr": 0.0, "weight_decay": 0.0}]
scheduler = OptimizerParamScheduler(
    Optimizer(), init_lr=case["warmup_init"], max_lr=case["max_lr"], min_lr=case["min_lr"],
    lr_warmup_steps=case["warmup_iters"], lr_decay_steps=case["decay_iters"],
    lr_decay_style=case["decay_style"], start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
    wd_incr_style="constant", wsd_decay_steps=case["wsd_decay_iters"],
    lr_wsd_decay_style=case["wsd_decay_style"])
updates, logged = [], []
for _ in range(case["iterations"]):
    updates.append(scheduler.optimizer.param_groups[0]["lr"])
    scheduler.step(increment=1)
    logged.append(scheduler.optimizer.param_groups[0]["lr"])
print(json.dumps([updates, logged]))
"""

CASES = {
    "linear-warmup-from-0": dict(decay_style="linear", warmup_iters=4, warmup_init=0.0),
    "cosine-warmup-from-init": dict(decay_style="cosine", warmup_iters=3, warmup_init=1e-5),
    "wsd": dict(decay_style="WSD", warmup_iters=2, wsd_decay_iters=5),
    "constant-no-warmup": dict(decay_style="constant", warmup_iters=0),
}


def _megatron_core(case: dict) -> list[list[float]]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(_venv_python()), "-c", MCORE_LOOP, json.dumps(case)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _ours(case: dict) -> list[list[float]]:
    class Optimizer:
        param_groups = [{"lr": 0.0}]

    config = LRScheduleConfig(
        max_lr=case["max_lr"],
        min_lr=case["min_lr"],
        warmup_iters=case["warmup_iters"],
        decay_iters=case["decay_iters"],
        decay_style=case["decay_style"],
        warmup_init=case["warmup_init"],
        wsd_decay_iters=case["wsd_decay_iters"],
        wsd_decay_style=case["wsd_decay_style"],
    )
    scheduler = OptimizerParamScheduler(Optimizer(), config=config)
    updates, logged = [], []
    for _ in range(case["iterations"]):  # megatron/training/training.py's loop, its order
        updates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step()
        logged.append(scheduler.get_lr())
    return [updates, logged]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_update_and_log_line_has_megatron_cores_lr(name):
    case = dict(max_lr=1e-3, min_lr=1e-4, decay_iters=10, iterations=ITERATIONS, warmup_init=0.0)
    case.update(wsd_decay_iters=0, wsd_decay_style="exponential")
    case.update(CASES[name])
    reference = _megatron_core(case)
    ours = _ours(case)
    assert len(reference[0]) == ITERATIONS
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    if name == "linear-warmup-from-0":
        assert ours[0][0] == 0.0 and ours[1][0] == pytest.approx(2.5e-4)  # first update at lr 0
