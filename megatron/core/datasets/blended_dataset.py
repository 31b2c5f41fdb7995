"""Weighted blending of several datasets (Megatron's --data-path W1 PREFIX1 W2 PREFIX2 ...)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def build_blending_indices(weights: Sequence[float], *, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` draws, tracking the weights.

    Stride scheduling: the k-th sample of dataset d is due at time (k + 0.5) / w_d and draws are
    served in due order (ties to the lower dataset id). After any n draws each dataset has
    served close to n * w_d (within one sample for two datasets), like Megatron's greedy
    error-minimizing choice, but vectorized and prefix-stable (the first n draws never depend
    on `size`).
    """
    normalized = np.asarray(weights, dtype=np.float64)
    normalized = normalized / normalized.sum()
    dataset_ids, sample_ids, due_times = [], [], []
    for dataset_id, weight in enumerate(normalized):
        # Each dataset serves at most w_d * (size + D) + 1 of the first `size` draws.
        count = int(np.ceil(weight * size)) + len(normalized) + 1
        sample_id = np.arange(count, dtype=np.int64)
        dataset_ids.append(np.full(count, dataset_id, dtype=np.int64))
        sample_ids.append(sample_id)
        due_times.append((sample_id + 0.5) / weight)
    order = np.argsort(np.concatenate(due_times), kind="stable")[:size]
    return np.concatenate(dataset_ids)[order], np.concatenate(sample_ids)[order]


class BlendedDataset(torch.utils.data.Dataset):
    """Draw i comes from datasets[dataset_index[i]], its sample dataset_sample_index[i]."""

    def __init__(
        self, *, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"blending weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = [float(weight) / float(sum(weights)) for weight in weights]
        self.size = size
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            self.weights, size=size
        )
        for dataset_id, dataset in enumerate(self.datasets):
            drawn = self.dataset_sample_index[self.dataset_index == dataset_id]
            if drawn.size and int(drawn.max()) >= len(dataset):
                raise ValueError(
                    f"blended dataset {dataset_id} has {len(dataset)} samples but "
                    f"{int(drawn.max()) + 1} are drawn from it"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is outside [0, {self.size})")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]


def samples_needed_per_dataset(weights: Sequence[float], *, size: int) -> list[int]:
    """How many samples each dataset must provide for `size` blended draws."""
    dataset_index, sample_index = build_blending_indices(weights, size=size)
    needed = []
    for dataset_id in range(len(weights)):
        drawn = sample_index[dataset_index == dataset_id]
        needed.append(int(drawn.max()) + 1 if drawn.size else 0)
    return needed
