"""torch_dist checkpoints reshard across DP sizes and strategies, and export full params."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.flat_dtensor import local_piece
from megatron.core.distributed.fsdp.config import FsdpConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.toy_model import build_toy, train_steps, wrap_toy

SAVE_AT, TOTAL = 3, 13


def _state(run) -> dict:
    return {
        "model": run.model.sharded_state_dict(),
        "optimizer": run.optimizer.sharded_state_dict(),
        "iteration": torch.tensor(0),
    }


def _train_save_continue(rank: int, world_size: int, strategy: str, ckpt: str):
    run = wrap_toy(FsdpConfig(data_parallel_sharding_strategy=strategy))
    train_steps(run, range(SAVE_AT))
    state = _state(run)
    state["iteration"] = torch.tensor(SAVE_AT)
    # Sharded strategies: each rank's pieces are DTensors of the whole flat parameter (a rank
    # holding none of a parameter leaves it out); no_shard: plain replicated tensors.
    numels = {name: p.numel() for name, p in build_toy().named_parameters()}
    pieces = state["model"]["params"]
    sharded = strategy != "no_shard"
    assert all(isinstance(v, DTensor) == sharded for v in pieces.values())
    assert all(v.shape == (numels[name],) for name, v in pieces.items())
    held = torch.tensor([sum(local_piece(v).numel() for v in pieces.values())])
    dist.all_reduce(held)
    assert int(held) == sum(numels.values()) * (1 if sharded else world_size)
    dist_checkpointing.save(state, ckpt, process_group=None)
    # numpy: torch tensors would travel back to the test process through shared memory that
    # dies with the worker.
    saved_params = {name: t.numpy() for name, t in run.model.full_parameters().items()}
    losses, _ = train_steps(run, range(SAVE_AT, TOTAL))
    return losses, saved_params


def _resume(rank: int, world_size: int, strategy: str, ckpt: str):
    # A fresh model from a different init: every value must come from the checkpoint.
    run = wrap_toy(FsdpConfig(data_parallel_sharding_strategy=strategy))
    state = _state(run)
    dist_checkpointing.load(state, ckpt, process_group=None)
    run.model.load_sharded_state_dict(state["model"])
    run.optimizer.load_sharded_state_dict(state["optimizer"])
    assert int(state["iteration"]) == SAVE_AT
    losses, _ = train_steps(run, range(SAVE_AT, TOTAL))
    return losses


@pytest.mark.parametrize(
    "save_world,save_strategy,load_world,load_strategy",
    [(4, "optim_grads_params", 2, "optim_grads"), (2, "no_shard", 4, "optim_grads_params")],
)
def test_resume_at_other_dp_size(tmp_path, save_world, save_strategy, load_world, load_strategy):
    ckpt = str(tmp_path / "iter_0000003")
    results = run_distributed(_train_save_continue, save_world, save_strategy, ckpt)
    uninterrupted, saved_params = results[0]
    assert not (tmp_path / "iter_0000003.tmp").exists()
    resumed = run_distributed(_resume, load_world, load_strategy, ckpt)[0]
    assert len(resumed) == TOTAL - SAVE_AT
    for step, (got, want) in enumerate(zip(resumed, uninterrupted)):
        assert got == pytest.approx(want, rel=1e-6), f"step {SAVE_AT + step}"

    # One process, no process group: the full fp32 params as training had them at the save.
    exported = dist_checkpointing.load_full_model_params(ckpt)
    reference = dict(build_toy().named_parameters())
    assert sorted(exported) == sorted(reference)
    for name, value in exported.items():
        assert value.shape == reference[name].shape
        assert torch.equal(value, torch.from_numpy(saved_params[name])), name
