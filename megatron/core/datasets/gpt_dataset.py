"""GPT pretraining samples from a .bin/.idx corpus, with cached, seeded sampling indices."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.datasets import gpt_indices
from megatron.core.datasets.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

# Bump when the index algorithm changes so that stale caches are never read.
# 2: megatron-core's sample order (one RandomState, epochs shuffled together).
_INDEX_FORMAT_VERSION = 2
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
# The cached [smallest, largest] token id of a .bin; bump the version with the key's fields.
_TOKEN_RANGE_FORMAT_VERSION = 1
_TOKEN_RANGE_NAMES = ("id_range",)


@dataclass(kw_only=True)
class GPTDatasetConfig:
    """Everything that decides which tokens a GPT sample holds."""

    seq_length: int
    """Tokens per sample fed to the model (--seq-length); each sample reads seq_length + 1."""

    seed: int
    """Seed of the document and sample shuffles (--seed); 0 <= seed < 2**32."""

    data_path: list[str] | None = None
    """--data-path: [prefix] or [weight1, prefix1, weight2, prefix2, ...]; None with mock."""

    split: str = "969,30,1"
    """--split: train,valid,test proportions of each corpus's documents."""

    mock: bool = False
    """--mock-data: synthetic tokens from the seed, no files."""

    vocab_size: int
    """The tokenizer's vocab size (before model padding); must fit the corpus's token dtype."""

    eod_id: int
    """End-of-document id; masks the loss (eod_mask_loss) and resets positions after it."""

    path_to_cache: str | None = None
    """--data-cache-path: where the index .npy files go; None: `index-cache` next to the first
    prefix."""

    reset_position_ids: bool = False
    """--reset-position-ids: position ids restart at 0 after each eod token."""

    eod_mask_loss: bool = False
    """--eod-mask-loss: loss_mask is 0.0 where the input token is eod."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.seq_length}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32) for the data shuffles, got {self.seed}")
        if self.vocab_size < 1 or not 0 <= self.eod_id < self.vocab_size:
            raise ValueError(
                f"eod id {self.eod_id} must lie in the vocabulary [0, {self.vocab_size}); "
                "take both from the tokenizer (tokenizer.eod, tokenizer.vocab_size)"
            )
        if not self.mock and not self.data_path:
            raise ValueError(
                "give --data-path PREFIX (made by tools/preprocess_data.py) or --mock-data"
            )


def build_item(
    sample_tokens: np.ndarray, *, eod_id: int, reset_position_ids: bool, eod_mask_loss: bool
) -> dict[str, torch.Tensor]:
    """tokens/labels/loss_mask/position_ids of one sample from its seq_length + 1 tokens."""
    sample = np.asarray(sample_tokens, dtype=np.int64)
    tokens, labels = sample[:-1], sample[1:]
    seq_length = tokens.size
    loss_mask = np.ones(seq_length, dtype=np.float32)
    is_eod = tokens == eod_id
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(seq_length, dtype=np.int64)
    if reset_position_ids:
        # Position k counts from the token after the last eod before k.
        segment_start = np.where(np.concatenate([[False], is_eod[:-1]]), position_ids, 0)
        position_ids = position_ids - np.maximum.accumulate(segment_start)
    return {
        "tokens": torch.from_numpy(tokens.copy()),
        "labels": torch.from_numpy(labels.copy()),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
    }


def check_vocab_fits(indexed_dataset: IndexedDataset, *, vocab_size: int, eod_id: int) -> None:
    """The vocabulary's largest id and eod must be representable in the corpus's token dtype."""
    dtype = indexed_dataset.dtype
    largest = int(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer) else 2**24
    for name, token_id in (("vocab size - 1", vocab_size - 1), ("eod id", eod_id)):
        if token_id > largest:
            raise ValueError(
                f"{name} = {token_id} does not fit the {dtype} tokens of "
                f"{indexed_dataset.bin_path} (max {largest}): the corpus was preprocessed with a "
                "smaller vocabulary; re-run tools/preprocess_data.py with this tokenizer"
            )


def _token_range_cache_key(indexed_dataset: IndexedDataset) -> str:
    # Sizes and modification times identify the files' contents, as for Python's .pyc
    # caches: tools/preprocess_data.py writes a new pair (new mtimes) and a moved corpus keeps
    # its cache. Hashing the tokens would cost as much as the scan it saves.
    description = {"format": _TOKEN_RANGE_FORMAT_VERSION, "dtype": str(indexed_dataset.dtype)}
    for suffix, path in (("bin", indexed_dataset.bin_path), ("idx", indexed_dataset.idx_path)):
        stat = os.stat(path)
        description[f"{suffix}_bytes"] = stat.st_size
        description[f"{suffix}_mtime_ns"] = stat.st_mtime_ns
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def corpus_token_id_range(indexed_dataset: IndexedDataset, *, cache_dir: str) -> tuple[int, int]:
    """Exact (smallest, largest) token id of the corpus, scanned once and cached in cache_dir."""
    cache_prefix = os.path.join(cache_dir, f"{_token_range_cache_key(indexed_dataset)}-tokens")

    def scan() -> tuple[np.ndarray]:
        started = time.monotonic()
        low, high = indexed_dataset.token_id_range()
        logger.info(
            "scanned %d tokens of %s for their id range in %.2f s (cached in %s)",
            indexed_dataset.num_tokens,
            indexed_dataset.bin_path,
            time.monotonic() - started,
            cache_dir,
        )
        return (np.array([low, high], dtype=np.int64),)

    (id_range,), _ = load_or_build(cache_prefix, scan, names=_TOKEN_RANGE_NAMES)
    return int(id_range[0]), int(id_range[1])


def check_token_ids_in_vocab(
    indexed_dataset: IndexedDataset, *, vocab_size: int, cache_dir: str
) -> None:
    """Every token id must be an embedding row, 0 <= id < vocab_size; the embedding would
    otherwise fail with an IndexError a few iterations into training."""
    low, high = corpus_token_id_range(indexed_dataset, cache_dir=cache_dir)
    path = indexed_dataset.bin_path
    if low < 0:
        raise ValueError(
            f"{path} holds token id {low}, but token ids are >= 0: the file is corrupt or was "
            "not written by tools/preprocess_data.py; re-run it"
        )
    if high >= vocab_size:
        raise ValueError(
            f"{path} holds token ids up to {high}, but the tokenizer's vocabulary has "
            f"{vocab_size} ids (0..{vocab_size - 1}): the corpus was made with a larger "
            f"vocabulary. With --tokenizer-type NullTokenizer pass --vocab-size {high + 1} or "
            "more; otherwise pass the tokenizer that made the corpus, or re-run "
            "tools/preprocess_data.py with this one"
        )


class GPTDataset(torch.utils.data.Dataset):
    """Samples of one split of one corpus, in megatron-core's order: item i depends on the
    data, seed, split, seq_length and the number of samples requested (gpt_indices explains).

    `indices_source` is "built" when this process built the indices, "cache" when it read them.
    """

    def __init__(
        self,
        *,
        indexed_dataset: IndexedDataset,
        split_name: str,
        document_range: tuple[int, int],
        num_samples: int,
        config: GPTDatasetConfig,
        cache_dir: str,
    ) -> None:
        check_vocab_fits(indexed_dataset, vocab_size=config.vocab_size, eod_id=config.eod_id)
        self.indexed_dataset = indexed_dataset
        self.split_name = split_name
        self.config = config
        first, stop = document_range
        self.document_ids = np.arange(first, stop, dtype=np.int64)
        lengths = np.asarray(indexed_dataset.sequence_lengths[first:stop], dtype=np.int64)
        self.tokens_per_epoch = int(lengths.sum())
        if self.tokens_per_epoch == 0:
            raise ValueError(
                f"the {split_name} split (documents {first}..{stop - 1}) of "
                f"{indexed_dataset.path_prefix} holds no tokens; change --split"
            )
        self.requested_samples = num_samples
        self.num_epochs = gpt_indices.num_epochs_needed(
            num_samples=num_samples,
            tokens_per_epoch=self.tokens_per_epoch,
            seq_length=config.seq_length,
        )
        # Every whole sample of the laid-out epochs, as megatron-core: usually > num_samples.
        self.num_samples = gpt_indices.samples_in_epochs(
            self.num_epochs, tokens_per_epoch=self.tokens_per_epoch, seq_length=config.seq_length
        )
        key = self._cache_key(lengths, document_range)
        self.cache_prefix = os.path.join(cache_dir, f"{key}-GPTDataset-{split_name}")
        indices, self.indices_source = load_or_build(self.cache_prefix, self._build_indices)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _cache_key(self, lengths: np.ndarray, document_range: tuple[int, int]) -> str:
        # The indices depend only on these values; hashing the lengths (not the path) lets a
        # moved corpus keep its cache and makes a rewritten corpus miss it.
        description = {
            "format": _INDEX_FORMAT_VERSION,
            "lengths_md5": hashlib.md5(lengths.tobytes()).hexdigest(),
            "document_range": list(document_range),
            "seq_length": self.config.seq_length,
            "seed": self.config.seed,
            "requested_samples": self.requested_samples,
        }
        return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        started = time.monotonic()
        logger.info(
            "building GPT %s indices for %s: %d samples over %d epochs",
            self.split_name,
            self.indexed_dataset.path_prefix,
            self.num_samples,
            self.num_epochs,
        )
        indices = gpt_indices.build_indices(
            document_ids=self.document_ids,
            sequence_lengths=self.indexed_dataset.sequence_lengths,
            num_samples=self.requested_samples,
            seq_length=self.config.seq_length,
            seed=self.config.seed,
        )
        logger.info("built GPT %s indices in %.2f s", self.split_name, time.monotonic() - started)
        return indices

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, sample: int) -> np.ndarray:
        """The seq_length + 1 tokens of unshuffled sample `sample` (crossing documents)."""
        (first_pos, first_offset), (last_pos, last_offset) = self.sample_index[sample : sample + 2]
        get = self.indexed_dataset.get
        if first_pos == last_pos:
            document = self.document_index[first_pos]
            return get(document, offset=first_offset, length=last_offset - first_offset + 1)
        parts = [get(self.document_index[first_pos], offset=first_offset)]
        parts += [get(self.document_index[pos]) for pos in range(first_pos + 1, last_pos)]
        parts.append(get(self.document_index[last_pos], length=last_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        return build_item(
            self.sample_tokens(int(self.shuffle_index[index])),
            eod_id=self.config.eod_id,
            reset_position_ids=self.config.reset_position_ids,
            eod_mask_loss=self.config.eod_mask_loss,
        )


def _index_paths(cache_prefix: str, names: tuple[str, ...]) -> list[str]:
    return [f"{cache_prefix}-{name}.npy" for name in names]


def _read_cache(cache_prefix: str, names: tuple[str, ...]) -> tuple[np.ndarray, ...] | None:
    paths = _index_paths(cache_prefix, names)
    if not all(os.path.isfile(path) for path in paths):
        return None
    return tuple(np.load(path, mmap_mode="r") for path in paths)


def _write_cache(
    cache_prefix: str, indices: tuple[np.ndarray, ...], names: tuple[str, ...]
) -> None:
    os.makedirs(os.path.dirname(cache_prefix) or ".", exist_ok=True)
    # Temp name then rename: a reader (or a crash) never sees a half-written index.
    for path, array in zip(_index_paths(cache_prefix, names), indices):
        temp_path = f"{path}.tmp-{os.getpid()}"
        with open(temp_path, "wb") as handle:
            np.save(handle, array)
        os.replace(temp_path, path)


def load_or_build(
    cache_prefix: str,
    build: Callable[[], tuple[np.ndarray, ...]],
    *,
    names: tuple[str, ...] = _INDEX_NAMES,
) -> tuple[tuple[np.ndarray, ...], str]:
    """Read the cached arrays CACHE_PREFIX-NAME.npy, or build them (on rank 0 when
    torch.distributed is up).

    Other ranks wait on a barrier and read rank 0's files; if their cache directory is not
    shared with rank 0 they rebuild locally (the result is identical: it is seeded).
    """
    distributed = dist.is_available() and dist.is_initialized()
    cached = _read_cache(cache_prefix, names)
    if distributed:
        # Every rank must reach the barrier, so rank 0 decides before it, the others after.
        built = None
        if dist.get_rank() == 0 and cached is None:
            built = build()
            _write_cache(cache_prefix, built, names)
        dist.barrier()
        if built is not None:
            return built, "built"
        cached = _read_cache(cache_prefix, names)
        if cached is None:
            logger.warning("index cache %s is not visible here; rebuilding locally", cache_prefix)
            return build(), "built"
        return cached, "cache"
    if cached is not None:
        return cached, "cache"
    built = build()
    _write_cache(cache_prefix, built, names)
    return built, "built"
