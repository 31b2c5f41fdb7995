"""get_micro_batch: this rank's samples of a micro-batch step, stacked, on the run's device
(on a GPU through pinned memory without a host wait; the same values)."""

from __future__ import annotations

import pytest
import torch

from megatron.training.data import get_micro_batch


class _Samples(torch.utils.data.Dataset):
    """Sample i: tokens i*10 .. i*10+3, labels shifted by one, every loss counted."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> dict:
        tokens = torch.arange(4) + 10 * index
        return {
            "tokens": tokens,
            "labels": tokens + 1,
            "loss_mask": torch.ones(4),
            "position_ids": torch.arange(4),
        }


def _check(batch: dict, first: int, device: torch.device) -> None:
    want = torch.stack([torch.arange(4) + 10 * i for i in (first, first + 1)])
    assert batch["tokens"].device.type == device.type
    assert torch.equal(batch["tokens"].cpu(), want)
    assert torch.equal(batch["labels"].cpu(), want + 1)
    assert batch["loss_mask"].shape == (2, 4) and batch["position_ids"].shape == (2, 4)


def test_rank_one_takes_its_samples_of_the_step():
    """Micro-batch 2 at data-parallel rank 1 of a step starting at sample 6: samples 8, 9."""
    device = torch.device("cpu")
    batch = get_micro_batch(_Samples(), first_sample=6, micro_batch_size=2, rank=1, device=device)
    _check(batch, 8, device)


@pytest.mark.gpu
def test_gpu_batches_come_through_pinned_memory_with_the_same_values():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    batch = get_micro_batch(_Samples(), first_sample=6, micro_batch_size=2, rank=1, device=device)
    torch.cuda.synchronize()
    _check(batch, 8, device)
