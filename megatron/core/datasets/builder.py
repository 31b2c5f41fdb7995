"""build_gpt_datasets: --data-path/--split/--mock-data -> train, valid, test datasets."""

from __future__ import annotations

import logging
import math
import os

import torch

from megatron.core.datasets.blended_dataset import BlendedDataset, blend_sizes, normalize_weights
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    check_token_ids_in_vocab,
    check_vocab_fits,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.mock_dataset import MockGPTDataset

Dataset = torch.utils.data.Dataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """[prefix] -> [(1.0, prefix)]; [w1, p1, w2, p2, ...] -> [(w1, p1), (w2, p2), ...]."""
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) == 0 or len(data_path) % 2:
        raise ValueError(
            f"--data-path {' '.join(data_path)!r}: give one prefix, or pairs of weight and "
            "prefix such as '0.75 corpus_a_text_document 0.25 corpus_b_text_document'"
        )
    blend = []
    for weight_text, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(
                f"--data-path weight {weight_text!r} (before {prefix!r}) is not a number; "
                "use the form 'WEIGHT PREFIX WEIGHT PREFIX ...'"
            ) from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"--data-path weight {weight_text!r} for {prefix!r} must be a positive number"
            )
        blend.append((weight, prefix))
    return blend


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1', or fewer values padded with 0) -> normalized weights."""
    try:
        values = [float(part) for part in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(
            f"--split {split!r} must be up to three comma-separated numbers such as '969,30,1'"
        ) from None
    if len(values) > 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(
            f"--split {split!r} must be up to three finite non-negative numbers with a positive sum"
        )
    values += [0.0] * (3 - len(values))
    return normalize_weights(values)


def split_document_ranges(num_documents: int, split_weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous [first, stop) document ranges per split, as megatron-core cuts them: the
    cumulative split fractions, each rounded (half to even) to a document count."""
    fractions = [0.0]
    for weight in split_weights:
        fractions.append(fractions[-1] + weight)
    bounds = [int(round(fraction * num_documents)) for fraction in fractions]
    return [(bounds[index], bounds[index + 1]) for index in range(len(split_weights))]


def default_cache_dir(config: GPTDatasetConfig, first_prefix: str) -> str:
    """config.path_to_cache, or an `index-cache` directory next to the first corpus."""
    if config.path_to_cache is not None:
        return config.path_to_cache
    return os.path.join(os.path.dirname(os.path.abspath(first_prefix)), "index-cache")


def _open_corpora(config: GPTDatasetConfig) -> list[tuple[float, IndexedDataset]]:
    """Parse --data-path and open/validate every corpus before any index is built."""
    corpora = []
    for weight, prefix in parse_data_path(list(config.data_path or [])):
        indexed = IndexedDataset(prefix)
        check_vocab_fits(indexed, vocab_size=config.vocab_size, eod_id=config.eod_id)
        corpora.append((weight, indexed))
    return corpora


def _build_split(
    *,
    config: GPTDatasetConfig,
    corpora: list[tuple[float, IndexedDataset]],
    split_index: int,
    num_samples: int,
    cache_dir: str,
    weighted: bool,
) -> Dataset | None:
    split_name = SPLIT_NAMES[split_index]
    split_weights = parse_split(config.split)
    parts = []
    for weight, indexed in corpora:
        document_range = split_document_ranges(len(indexed), split_weights)[split_index]
        if document_range[1] > document_range[0]:
            parts.append((weight, indexed, document_range))
        else:  # info: shown once (rank 0), not once per rank as a warning would be
            logger.info(
                "%s: the %s split is empty (--split %s)",
                indexed.path_prefix,
                split_name,
                config.split,
            )
    if not parts:
        if split_index == 0:
            raise ValueError(
                f"the train split is empty for --split {config.split!r}: every corpus has too "
                "few documents for it; give train a larger share"
            )
        return None
    if weighted:
        # megatron-core blends whenever weights are given, even for one corpus.
        weights = normalize_weights([weight for weight, _, _ in parts])
        needed, blend_size = blend_sizes(weights, size=num_samples)
    else:
        needed = [num_samples]
    datasets = [
        GPTDataset(
            indexed_dataset=indexed,
            split_name=split_name,
            document_range=document_range,
            num_samples=max(count, 1),
            config=config,
            cache_dir=cache_dir,
        )
        for (_, indexed, document_range), count in zip(parts, needed)
    ]
    if not weighted:
        return datasets[0]
    return BlendedDataset(datasets=datasets, weights=weights, size=blend_size, cache_dir=cache_dir)


def build_gpt_datasets(
    config: GPTDatasetConfig, *, num_samples: tuple[int, int, int]
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """(train, valid, test) datasets with at least num_samples[i] samples each.

    A split is None when num_samples for it is 0 or (valid/test) it holds no documents. Item i
    depends only on the corpus files, seed, split and seq_length: the training loop slices
    global sample indices per data-parallel rank. Everything is validated here, before training.
    """
    if len(num_samples) != 3 or any(count < 0 for count in num_samples):
        raise ValueError(
            f"num_samples must be three counts >= 0 (train, valid, test): {num_samples}"
        )
    if config.mock:
        return tuple(
            MockGPTDataset(config=config, num_samples=count, split_name=name) if count else None
            for name, count in zip(SPLIT_NAMES, num_samples)
        )
    parse_split(config.split)  # fail on a bad --split before opening any file
    corpora = _open_corpora(config)
    cache_dir = default_cache_dir(config, corpora[0][1].path_prefix)
    # After every corpus opened: a missing one fails before any cache file is written.
    for _, indexed in corpora:
        check_token_ids_in_vocab(indexed, vocab_size=config.vocab_size, cache_dir=cache_dir)
    return tuple(
        _build_split(
            config=config,
            corpora=corpora,
            split_index=split_index,
            num_samples=count,
            cache_dir=cache_dir,
            weighted=len(config.data_path) > 1,
        )
        if count
        else None
        for split_index, count in enumerate(num_samples)
    )
