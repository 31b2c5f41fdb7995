"""FP8-parameter checkpoints hold fp32 main params (+ delayed-scaling state): they resume at
another DP size, and a high-precision checkpoint resumes in FP8, with the same next-step loss."""

from __future__ import annotations

import pytest

from megatron.core import dist_checkpointing
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.fp8_toy import build_fp8_toy, fp8_config, train, wrap
from tests.unit_tests.distributed.test_fp8_exact_bytes import _check_gathered

SAVE_AT = 3


def _state(run, *, fp8_scaling_state: bool = True) -> dict:
    return {
        "model": run.model.sharded_state_dict(fp8_scaling_state=fp8_scaling_state),
        "optimizer": run.optimizer.sharded_state_dict(),
    }


def _save(rank: int, world_size: int, ckpt_dir: str) -> dict:
    next_loss = {}
    for name, recipe in (("delayed", "delayed"), ("tensorwise", "tensorwise"), ("hp", None)):
        config = None if recipe is None else fp8_config(recipe)
        run = wrap(build_fp8_toy(config), strategy="optim_grads_params", config=config)
        train(run, range(SAVE_AT), config=config)
        state = _state(run)
        assert ("fp8_delayed_scaling" in state["model"]) == (recipe == "delayed")
        dist_checkpointing.save(state, f"{ckpt_dir}/{name}", process_group=None)
        next_loss[name] = train(run, range(SAVE_AT, SAVE_AT + 1), config=config)[0]
    return next_loss


def _resume(ckpt: str, recipe: str, *, param_gather: bool, scaling_state: bool):
    config = fp8_config(recipe, param_gather=param_gather)
    # A different init (the layer count is the same, values come from the checkpoint only).
    run = wrap(build_fp8_toy(config), strategy="optim_grads", config=config)
    for param in run.model.engine.buffer.all_groups():
        param.main_shard.fill_(0.5)
    state = _state(run, fp8_scaling_state=scaling_state)
    dist_checkpointing.load(state, ckpt, process_group=None)
    run.model.load_sharded_state_dict(state["model"])
    run.optimizer.load_sharded_state_dict(state["optimizer"])
    checked = _check_gathered(run, config) if param_gather else 0
    return train(run, range(SAVE_AT, SAVE_AT + 1), config=config)[0], checked


def _load_all(rank: int, world_size: int, ckpt_dir: str) -> dict:
    result = {}
    # Same recipe, other DP size and strategy: the saved delayed scales carry over.
    result["delayed"] = _resume(
        f"{ckpt_dir}/delayed", "delayed", param_gather=True, scaling_state=True
    )
    # Recipe switches: a high-precision checkpoint and a tensorwise one resume in FP8;
    # the reference is the same recipe with fp8_param_gather off, loaded the same way.
    for source, recipe in (("hp", "mxfp8"), ("hp", "delayed"), ("tensorwise", "blockwise")):
        for gather in (True, False):
            result[f"{source}->{recipe}/{gather}"] = _resume(
                f"{ckpt_dir}/{source}", recipe, param_gather=gather, scaling_state=False
            )
    return result


def test_resume_across_dp_size_and_recipe(tmp_path) -> None:
    saved = run_distributed(_save, 2, str(tmp_path))[0]
    resumed = run_distributed(_load_all, 4, str(tmp_path))[0]
    loss, checked = resumed["delayed"]
    assert checked == 8  # FP8 bytes after the load equal one-rank quantize of the main params
    assert loss == pytest.approx(saved["delayed"], rel=1e-6)
    for source, recipe in (("hp", "mxfp8"), ("hp", "delayed"), ("tensorwise", "blockwise")):
        (on, checked), (off, _) = (resumed[f"{source}->{recipe}/{g}"] for g in (True, False))
        assert checked == 8, (source, recipe)
        assert on == pytest.approx(off, rel=1e-6), (source, recipe)
        # The checkpoint's weights, not the fill value, are what trains on.
        assert abs(on - saved[source]) < 0.05, (source, recipe)
