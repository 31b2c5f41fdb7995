"""Issue 40, acceptance 3 (the resume rows) on CPU/gloo: a torch_dist checkpoint holds every
tensor-parallel shard as its full (TP = 1) tensor, so a run saved at TP 2 x DP 2 (Megatron-FSDP
ZeRO-3) resumes at TP 1 x DP 4 and TP 4 x DP 1 with the next 10 losses of the uninterrupted
run within 1e-6 (fp32, fp64 grad buffers), and its params equal TP 1's layout."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.tp_placement import TensorParallelPlacement, TensorSplit
from megatron.core.tensor_parallel.layers import shard_blocks
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain_on_rank

SAVE_AT, STEPS = 10, 20
FP64_GRADS = ["--main-grads-dtype", "fp64"]
ARGV = TINY_GPT + NO_DROPOUT + FP64_GRADS + ["--train-iters", str(STEPS), "--swiglu"]


def _zero3(tp: int) -> list[str]:
    return [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--ckpt-format",
        "torch_dist",
        "--tensor-model-parallel-size",
        str(tp),
    ]


@pytest.mark.parametrize(
    "split",
    [
        TensorSplit(0, (12, 4, 4), (20, 3)),  # QKV-like blocks
        TensorSplit(0, (8, 8), (16, 5)),  # SwiGLU [gate | up]
        TensorSplit(0, (8,), (8,)),  # a column-parallel bias
        TensorSplit(1, (8,), (3, 8)),  # row-parallel
    ],
)
def test_runs_place_every_piece_of_a_shard_in_the_full_tensor(split) -> None:
    tp_size = 4
    full = torch.arange(math.prod(split.full_shape), dtype=torch.float64)
    full = full.view(split.full_shape)
    for tp_rank in range(tp_size):
        placement = TensorParallelPlacement({"p": split}, tp_rank, tp_size)
        if split.dim == 0:
            shard = shard_blocks(full, split.blocks, 0, tp_size, tp_rank).reshape(-1)
        else:
            shard = full.chunk(tp_size, dim=1)[tp_rank].reshape(-1)
        pieces = [(0, shard.numel()), (1, shard.numel() - 2), (3, 2), (5, 0)]
        for start, numel in [(s, n) for s, n in pieces if s + n <= shard.numel()]:
            got = torch.empty(numel, dtype=torch.float64)
            covered = 0
            for run in placement.runs("p", start, numel):
                assert run.local == covered
                got[run.local : run.local + run.length] = full.view(-1)[
                    run.full : run.full + run.length
                ]
                covered += run.length
            assert covered == numel
            assert torch.equal(got, shard[start : start + numel]), (tp_rank, start, numel)


@pytest.fixture(scope="module")
def saved_at_tp2_dp2(tmp_path_factory):
    """One TP 2 x DP 2 run of 20 steps that saves at step 10: (its losses, the directory)."""
    save = str(tmp_path_factory.mktemp("tp2dp2"))
    argv = ARGV + _zero3(2) + ["--save", save, "--save-interval", str(SAVE_AT)]
    per_rank = run_distributed(run_pretrain_on_rank, 4, argv)
    return per_rank[0], save


def test_checkpoint_holds_the_full_tensors(saved_at_tp2_dp2) -> None:
    """TP 1's shapes (SwiGLU fc1 [2 x 256, 64], fc2 [64, 256], QKV, the vocabulary rows), and
    fc1's gate and up halves where TP 1 has them: both halves' rows the same size."""
    _, save = saved_at_tp2_dp2
    params = dist_checkpointing.load_full_model_params(f"{save}/iter_{SAVE_AT:07d}/sharded")
    layer = "decoder.layers.0"
    assert params[f"{layer}.mlp.linear_fc1.weight"].shape == (512, 64)
    assert params[f"{layer}.mlp.linear_fc2.weight"].shape == (64, 256)
    assert params[f"{layer}.self_attention.linear_qkv.weight"].shape == (192, 64)
    assert params[f"{layer}.self_attention.linear_proj.weight"].shape == (64, 64)
    assert params["embedding.word_embeddings.weight"].shape == (512, 64)


RESUMES = {
    "megatron-fsdp-tp1xdp4": _zero3(1),
    "megatron-fsdp-tp4xdp1": _zero3(4),
    "ddp-tp4xdp1": ["--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "4"],
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_at_another_tensor_parallel_size(saved_at_tp2_dp2, name) -> None:
    uninterrupted, save = saved_at_tp2_dp2
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    argv = ARGV + RESUMES[name] + ["--load", save, "--ckpt-step", str(SAVE_AT)]
    if name.startswith("ddp"):
        argv = [a for a in argv if a not in FP64_GRADS]  # DDP: grads in the param dtype
    resumed = run_distributed(run_pretrain_on_rank, 4, argv)
    for rank, losses in enumerate(resumed):
        assert sorted(losses) == list(range(SAVE_AT + 1, STEPS + 1)), rank
        for iteration, loss in losses.items():
            want = uninterrupted[iteration]
            assert abs(loss - want) <= 1e-6 * abs(want), (name, rank, iteration, loss, want)
