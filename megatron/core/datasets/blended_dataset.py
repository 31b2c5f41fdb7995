"""Weighted blending of several datasets (Megatron's --data-path W1 PREFIX1 W2 PREFIX2 ...)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.blending_indices import build_blending_indices
from megatron.core.datasets.gpt_dataset import load_or_build

# Bump when build_blending_indices changes so that stale caches are never read.
_BLEND_FORMAT_VERSION = 1


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """weights / sum(weights) in float64, as megatron-core's `normalize` (same bits)."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


class BlendedDataset(torch.utils.data.Dataset):
    """Draw i comes from datasets[dataset_index[i]], its sample dataset_sample_index[i]."""

    def __init__(
        self,
        *,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"blending weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = self._indices(cache_dir)
        for dataset_id, dataset in enumerate(self.datasets):
            drawn = self.dataset_sample_index[self.dataset_index == dataset_id]
            if drawn.size and int(drawn.max()) >= len(dataset):
                raise ValueError(
                    f"blended dataset {dataset_id} has {len(dataset)} samples but "
                    f"{int(drawn.max()) + 1} are drawn from it"
                )

    def _indices(self, cache_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
        """build_blending_indices, cached next to the datasets' indices when they are cached:
        its exact greedy loop costs about 1 s per million draws, so a long run pays it once."""

        def build() -> tuple[np.ndarray, np.ndarray]:
            return build_blending_indices(self.weights, size=self.size)

        prefixes = [getattr(dataset, "cache_prefix", None) for dataset in self.datasets]
        if cache_dir is None or None in prefixes:
            return build()
        description = {
            "format": _BLEND_FORMAT_VERSION,
            "datasets": [os.path.basename(prefix) for prefix in prefixes],
            "weights": self.weights,
            "size": self.size,
        }
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        (dataset_index, sample_index), _ = load_or_build(
            os.path.join(cache_dir, f"{key}-BlendedDataset"),
            build,
            names=("dataset_index", "dataset_sample_index"),
        )
        return dataset_index, sample_index

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is outside [0, {self.size})")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]


# megatron-core builds each blended dataset 0.5% larger than its share (its default
# mid_level_dataset_surplus), which changes that dataset's shuffle; kept for the same order.
MID_LEVEL_SURPLUS = 0.005


def blend_sizes(normalized_weights: Sequence[float], *, size: int) -> tuple[list[int], int]:
    """(samples requested from each dataset, size of the blend), as megatron-core's builder:
    dataset d is asked for ceil(ceil(size * w_d) * 1.005) samples, and the blend draws
    sum(ceil(size * w_d)) >= size times."""
    shares = [math.ceil(size * weight) for weight in normalized_weights]
    requested = [math.ceil(share * (1 + MID_LEVEL_SURPLUS)) for share in shares]
    return requested, sum(shares)
