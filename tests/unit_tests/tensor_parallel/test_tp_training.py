"""Issue 40, acceptance 1 (first rows) on CPU/gloo: the tiny GPT trains 20 fp32 steps at
TP 2 x DP 1, with and without --sequence-parallel, at TP 2 x DP 2 under torch DDP and at TP 4
with --sequence-parallel, with
the single-process losses within 1e-5 (the grad norm, and so the clip, is the TP = 1 one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.training.training import seed_dropout
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)

STEPS = 20
ARGV = TINY_GPT + NO_DROPOUT + ["--train-iters", str(STEPS)]
TP2 = ["--tensor-model-parallel-size", "2"]
_REFERENCE: dict[int, float] = {}


def _reference() -> dict[int, float]:
    if not _REFERENCE:
        _REFERENCE.update(run_pretrain(ARGV).losses)
    return _REFERENCE


@pytest.mark.parametrize(
    "extra, world_size",
    [
        (TP2, 2),
        (TP2 + ["--sequence-parallel"], 2),
        (TP2, 4),
        (TP2 + ["--sequence-parallel"], 4),
        (["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4),
    ],
    ids=["tp2", "tp2-sp", "tp2xdp2", "tp2xdp2-sp", "tp4-sp"],
)
def test_tensor_parallel_losses_equal_one_process(extra, world_size) -> None:
    reference = _reference()
    assert sorted(reference) == list(range(1, STEPS + 1))
    per_rank = run_distributed(run_pretrain_on_rank, world_size, ARGV + extra)
    for rank, losses in enumerate(per_rank):
        assert sorted(losses) == sorted(reference), rank
        for iteration, loss in losses.items():
            assert loss == pytest.approx(reference[iteration], abs=1e-5), (rank, iteration)
    # Training moved the loss: the comparison is not between two untrained models.
    assert reference[STEPS] < reference[1] - 0.1


def test_sequence_parallel_dropout_streams_differ_by_tp_rank_only_when_asked() -> None:
    seed_dropout(1234, first_sample=16)
    shared = torch.rand(4)
    mixed = np.random.SeedSequence([1234, 16]).generate_state(1, np.uint64)[0]
    torch.manual_seed(int(mixed) >> 1)
    assert torch.equal(shared, torch.rand(4))  # stream 0: the draw of every run before TP
    seed_dropout(1234, first_sample=16, stream=1)
    rank0 = torch.rand(4)
    seed_dropout(1234, first_sample=16, stream=2)
    assert not torch.equal(rank0, torch.rand(4)) and not torch.equal(rank0, shared)
