"""The three GPT sampling indices, built deterministically from the seed with numpy only.

Terms: the split's documents are laid out epoch after epoch (each epoch a seeded permutation of
the split's documents) into one long token stream. Sample i is the seq_length + 1 tokens at
stream positions [i * seq_length, i * seq_length + seq_length]: samples cross document
boundaries and consecutive samples share one token (the last input's label is the next
sample's first input), as in Megatron-LM.

- document index: the document ids in stream order (all epochs concatenated);
- sample index [num_samples + 1, 2]: for each sample start, (position in the document index,
  token offset in that document); sample i ends at entry i + 1, inclusive;
- shuffle index: the order in which samples are served.

Unlike Megatron-LM, every epoch is shuffled with its own seeded stream and samples are shuffled
within the epoch they start in, so sample i never depends on how many samples were requested:
a run that asks for more iterations sees the same first samples.
"""

from __future__ import annotations

import logging
import time

import numpy as np

logger = logging.getLogger(__name__)

# Streams of the per-epoch RandomState seeds: [seed, epoch, purpose].
_DOCUMENT_STREAM = 0
_SAMPLE_STREAM = 1


def epoch_plan(*, num_samples: int, tokens_per_epoch: int, seq_length: int) -> tuple[int, int]:
    """(epochs whose samples are served, epochs laid out in the document index).

    Enough epochs E that ceil(E * T / S) >= num_samples; then enough extra epochs that the
    last served sample (which starts before E * T) can take its seq_length more tokens.
    """
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; its documents are all empty")
    if num_samples < 1 or seq_length < 1:
        raise ValueError(f"num_samples and seq_length must be >= 1 ({num_samples}, {seq_length})")
    served_epochs = (num_samples - 1) * seq_length // tokens_per_epoch + 1
    extra_epochs = -(-seq_length // tokens_per_epoch)
    return served_epochs, served_epochs + extra_epochs


def samples_before_epoch(epoch: int, *, tokens_per_epoch: int, seq_length: int) -> int:
    """How many samples start before stream position epoch * tokens_per_epoch."""
    return -(-epoch * tokens_per_epoch // seq_length)


def build_document_index(document_ids: np.ndarray, *, num_epochs: int, seed: int) -> np.ndarray:
    """Each epoch a permutation of document_ids drawn from RandomState([seed, epoch, 0])."""
    started = time.monotonic()
    epochs = []
    for epoch in range(num_epochs):
        rng = np.random.RandomState([seed, epoch, _DOCUMENT_STREAM])
        epochs.append(rng.permutation(np.asarray(document_ids, dtype=np.int64)))
        if time.monotonic() - started > 10 and epoch % 10 == 0:
            logger.info("document index: %d of %d epochs shuffled", epoch + 1, num_epochs)
    return np.concatenate(epochs) if epochs else np.zeros(0, dtype=np.int64)


def build_sample_index(
    *, sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """[num_samples + 1, 2] int64 of (document index position, token offset) per sample start.

    Vectorized: the document holding stream position p is the first one whose cumulative end
    exceeds p (side="right" skips empty documents, which hold no position).
    """
    document_lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    document_ends = np.cumsum(document_lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if positions[-1] >= document_ends[-1]:
        raise ValueError(
            f"the document index holds {document_ends[-1]} tokens, too few for {num_samples} "
            f"samples of {seq_length} + 1 tokens"
        )
    holders = np.searchsorted(document_ends, positions, side="right")
    offsets = positions - (document_ends[holders] - document_lengths[holders])
    return np.stack([holders, offsets], axis=1).astype(np.int64)


def build_shuffle_index(
    *, served_epochs: int, tokens_per_epoch: int, seq_length: int, seed: int
) -> np.ndarray:
    """Samples starting in epoch e are permuted among themselves by RandomState([seed, e, 1])."""
    bounds = [
        samples_before_epoch(epoch, tokens_per_epoch=tokens_per_epoch, seq_length=seq_length)
        for epoch in range(served_epochs + 1)
    ]
    parts = []
    for epoch in range(served_epochs):
        rng = np.random.RandomState([seed, epoch, _SAMPLE_STREAM])
        parts.append(rng.permutation(np.arange(bounds[epoch], bounds[epoch + 1], dtype=np.int64)))
    return np.concatenate(parts)
