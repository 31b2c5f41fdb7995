"""Issue 38: checkpoints of expert-parallel runs (--save/--load with
--expert-model-parallel-size). A tiny MoE GPT saved at 4 gloo ranks with EP 2, under
Megatron-FSDP ZeRO-3 and under DDP, resumes at EP 2 and, resharding its experts, at EP 4 and
EP 1 (and under HSDP 2 x 2): the next losses equal the uninterrupted run's within 1e-6. The
sharded checkpoint holds each routed expert as the full [num_experts, ...] tensor by global
expert index, like the dense torch_dist layout, so a run of any EP size reads it."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.core.dist_checkpointing.flat_dtensor import ExpertPlacement
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import run_pretrain, run_pretrain_on_rank
from tests.unit_tests.training.test_moe_training import TINY_MOE

SAVE_AT, TOTAL = 3, 6
BASE = [*TINY_MOE, "--train-iters", str(TOTAL)]
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
DDP: list[str] = []
HSDP = [*ZERO3, "--num-distributed-optimizer-instances", "2"]
RESUMED = list(range(SAVE_AT + 1, TOTAL + 1))
SLOW = pytest.mark.slow  # the cross-engine resumes (4 more 4-rank runs)
EXPERT_WEIGHT = "decoder.layers.1.mlp.experts.linear_fc1.weight"


def _ep(size: int) -> list[str]:
    return ["--expert-model-parallel-size", str(size)]


def _losses(world_size: int, argv: list[str]) -> dict[int, float]:
    if world_size == 1:
        return run_pretrain(argv).losses
    return run_distributed(run_pretrain_on_rank, world_size, argv)[0]


def _save(tmp_path_factory, engine: list[str]):
    """(directory, uninterrupted losses) of a 4-rank EP 2 run saving at SAVE_AT."""
    directory = tmp_path_factory.mktemp("moe") / "ckpt"
    argv = BASE + engine + _ep(2) + ["--save", str(directory)]
    return directory, _losses(4, argv + ["--save-interval", str(SAVE_AT)])


@pytest.fixture(scope="module")
def saved_megatron_fsdp(tmp_path_factory):
    return _save(tmp_path_factory, ZERO3)


@pytest.fixture(scope="module")
def saved_ddp(tmp_path_factory):
    return _save(tmp_path_factory, DDP)


def test_expert_placement_is_the_global_expert_index():
    placement = ExpertPlacement(frozenset({"w"}), ep_rank=1, ep_size=4)
    assert placement.place("w", 5, 24) == (29, 96)  # rank 1's rows follow rank 0's 24 elements
    assert placement.place("dense", 5, 24) == (5, 24)
    assert placement.global_shape("w", (2, 8, 3)) == (8, 8, 3)
    assert placement.global_shape("dense", (2, 8, 3)) == (2, 8, 3)


def test_checkpoint_holds_full_expert_tensors(saved_megatron_fsdp):
    from torch.distributed.checkpoint import FileSystemReader

    directory, _ = saved_megatron_fsdp
    iteration = directory / f"iter_{SAVE_AT:07d}"
    metadata = json.loads((iteration / "metadata.json").read_text())
    assert metadata["ckpt_format"] == "torch_dist"  # the default with EP
    assert metadata["param_shapes"][EXPERT_WEIGHT][0] == 4  # every expert, not a rank's 2
    stored = FileSystemReader(str(iteration / "sharded")).read_metadata()
    full = stored.state_dict_metadata[f"model.params.{EXPERT_WEIGHT}"]
    assert full.size[0] == 4 * torch.Size(metadata["param_shapes"][EXPERT_WEIGHT][1:]).numel()
    covered = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in full.chunks)
    assert covered[0][0] == 0 and sum(size for _, size in covered) == full.size[0]


@pytest.mark.parametrize(
    "saved, world_size, ep_size, engine",
    [
        pytest.param("saved_megatron_fsdp", 4, 2, ZERO3, id="fsdp-ep2"),
        pytest.param("saved_megatron_fsdp", 4, 4, ZERO3, id="fsdp-ep4"),
        pytest.param("saved_megatron_fsdp", 2, 1, ZERO3, id="fsdp-ep1-2ranks"),
        pytest.param("saved_megatron_fsdp", 4, 2, DDP, id="fsdp-to-ddp-ep2", marks=SLOW),
        pytest.param("saved_megatron_fsdp", 4, 2, HSDP, id="fsdp-to-hsdp-ep2", marks=SLOW),
        pytest.param("saved_ddp", 4, 2, DDP, id="ddp-ep2"),
        pytest.param("saved_ddp", 1, 1, DDP, id="ddp-ep1-1rank"),
        pytest.param("saved_ddp", 4, 4, ZERO3, id="ddp-to-fsdp-ep4", marks=SLOW),
    ],
)
def test_resume_at_another_expert_parallel_size(request, saved, world_size, ep_size, engine):
    directory, uninterrupted = request.getfixturevalue(saved)
    argv = BASE + engine + _ep(ep_size) + ["--load", str(directory), "--ckpt-step", str(SAVE_AT)]
    # EP 1 under DDP would default to --ckpt-format torch: name the checkpoint's format.
    resumed = _losses(world_size, argv + ["--ckpt-format", "torch_dist"])
    assert sorted(resumed) == RESUMED
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[iteration], rel=1e-6, abs=0), iteration
