"""Datasets from the flags, and the deterministic global-sample order every rank slices.

Sample order is a function of the global sample index only: iteration k's global batch is
samples [k * global_batch, (k + 1) * global_batch). Each micro-batch step takes
micro_batch x dp consecutive samples and rank r takes its r-th slice of micro_batch samples, as
Megatron's pretraining sampler does. So the set of samples in a step never depends on the
data-parallel size, and a resumed run continues with exactly the samples it would have seen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from megatron.core.datasets import GPTDatasetConfig, build_gpt_datasets
from megatron.core.tokenizer import Tokenizer, build_tokenizer
from megatron.training.flags.run_config import DataConfig, TokenizerConfig


@dataclass(frozen=True)
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None


def build_tokenizer_from_config(config: TokenizerConfig) -> Tokenizer:
    return build_tokenizer(**dataclasses.asdict(config))


def build_datasets(config: DataConfig, *, tokenizer: Tokenizer) -> Datasets:
    """Build (and validate) train/valid/test before any model exists."""
    dataset_config = GPTDatasetConfig(
        seq_length=config.seq_length,
        seed=config.seed,
        data_path=config.data_path,
        split=config.split,
        mock=config.mock_data,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod,
        path_to_cache=config.data_cache_path,
        reset_position_ids=config.reset_position_ids,
        eod_mask_loss=config.eod_mask_loss,
    )
    train, valid, test = build_gpt_datasets(dataset_config, num_samples=config.num_samples)
    if train is None:
        raise SystemExit(
            f"--split {config.split} leaves no training documents; give the first share a "
            "positive weight."
        )
    return Datasets(train=train, valid=valid, test=test)


def get_micro_batch(
    dataset: Dataset,
    *,
    first_sample: int,
    micro_batch_size: int,
    rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """This rank's micro-batch of a micro-batch step that starts at global sample first_sample."""
    start = first_sample + rank * micro_batch_size
    items = [dataset[index] for index in range(start, start + micro_batch_size)]
    return {
        key: _to_device(torch.stack([torch.as_tensor(item[key]) for item in items]), device)
        for key in ("tokens", "labels", "loss_mask", "position_ids")
    }


def _to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on `device`. To a GPU through pinned memory, without waiting: a copy from
    pageable memory first waits for all the GPU work queued before it (the previous step's
    optimizer), so the next step could not be queued while that runs. torch's pinned-memory
    cache keeps the pinned block until the copy has read it."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)
