"""Synthetic GPT samples from the seed alone (--mock-data): no files, no tokenizer."""

from __future__ import annotations

import numpy as np
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_item

# Seed streams so that train, valid and test draw different samples.
_SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset(torch.utils.data.Dataset):
    """Item i: documents of counting tokens (start, start+1, ...) each followed by eod.

    Every document length and start id comes from RandomState([seed, split, i]), so item i is
    the same for any number of samples, ranks or workers; the counting pattern gives a model
    something learnable, so the loss falls in smoke tests.
    """

    def __init__(self, *, config: GPTDatasetConfig, num_samples: int, split_name: str) -> None:
        if split_name not in _SPLIT_STREAMS:
            raise ValueError(f"split_name must be one of {list(_SPLIT_STREAMS)}, got {split_name}")
        if config.vocab_size < 2:
            raise ValueError(f"mock data needs vocab_size >= 2, got {config.vocab_size}")
        self.config = config
        self.num_samples = num_samples
        self.split_stream = _SPLIT_STREAMS[split_name]

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, index: int) -> np.ndarray:
        config = self.config
        rng = np.random.RandomState([config.seed, self.split_stream, index])
        needed = config.seq_length + 1
        pieces, filled = [], 0
        while filled < needed:
            length = int(rng.randint(1, 2 * config.seq_length + 1))
            start = int(rng.randint(0, config.vocab_size - 1))
            # Count over the non-eod ids only: shift ids at or above eod up by one.
            document = (start + np.arange(length, dtype=np.int64)) % (config.vocab_size - 1)
            document[document >= config.eod_id] += 1
            pieces += [document, np.array([config.eod_id], dtype=np.int64)]
            filled += length + 1
        return np.concatenate(pieces)[:needed]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        return build_item(
            self.sample_tokens(index),
            eod_id=self.config.eod_id,
            reset_position_ids=self.config.reset_position_ids,
            eod_mask_loss=self.config.eod_mask_loss,
        )
