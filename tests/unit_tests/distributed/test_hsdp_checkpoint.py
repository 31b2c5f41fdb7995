"""A checkpoint saved under HSDP (2 x 2) resumes under plain ZeRO-3 at 2 ranks and in one
process with the uninterrupted run's next 10 losses."""

from __future__ import annotations

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.distributed.fsdp.config import FsdpConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.test_hsdp import wrap_hsdp
from tests.unit_tests.distributed.toy_model import build_toy, train_steps, wrap_toy

SAVE_AT, TOTAL = 3, 13


def _state(run) -> dict:
    return {
        "model": run.model.sharded_state_dict(),
        "optimizer": run.optimizer.sharded_state_dict(),
        "iteration": torch.tensor(0),
    }


def _save_under_hsdp(rank: int, world_size: int, outer: str, ckpt: str) -> list[float]:
    config = FsdpConfig(outer_dp_sharding_strategy=outer)
    run = wrap_hsdp(build_toy(), instances=2, config=config)
    train_steps(run, range(SAVE_AT))
    state = _state(run)
    state["iteration"] = torch.tensor(SAVE_AT)
    dist_checkpointing.save(state, ckpt, process_group=None)
    losses, _ = train_steps(run, range(SAVE_AT, TOTAL))
    return losses


def _resume_plain(rank: int, world_size: int, ckpt: str) -> list[float]:
    run = wrap_toy(FsdpConfig())
    state = _state(run)
    dist_checkpointing.load(state, ckpt, process_group=None)
    run.model.load_sharded_state_dict(state["model"])
    run.optimizer.load_sharded_state_dict(state["optimizer"])
    assert int(state["iteration"]) == SAVE_AT
    losses, _ = train_steps(run, range(SAVE_AT, TOTAL))
    return losses


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp_checkpoint_resumes_at_other_layouts(tmp_path, outer: str) -> None:
    ckpt = str(tmp_path / "iter_0000003")
    uninterrupted = run_distributed(_save_under_hsdp, 4, outer, ckpt)[0]
    assert len(uninterrupted) == TOTAL - SAVE_AT
    for world_size in (2, 1):  # 1 x 2 (plain ZeRO-3), and one process
        resumed = run_distributed(_resume_plain, world_size, ckpt)[0]
        for step, (got, want) in enumerate(zip(resumed, uninterrupted)):
            assert got == pytest.approx(want, rel=1e-6), (world_size, SAVE_AT + step)
