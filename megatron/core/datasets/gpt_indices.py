"""The three GPT sampling indices, built as megatron-core (0.16) builds them, with numpy only.

Terms: the split's documents are laid out epoch after epoch into one long token stream. Sample i
is the seq_length + 1 tokens at stream positions [i * seq_length, i * seq_length + seq_length]:
samples cross document boundaries, and consecutive samples share one token (the last input's
label is the next sample's first input).

- document index: the document ids in stream order (all epochs concatenated);
- sample index [num_samples + 1, 2]: for each sample start, (position in the document index,
  token offset in that document); sample i ends at entry i + 1, inclusive;
- shuffle index: the order in which samples are served.

For the same corpus, seed, split and seq_length, the arrays' contents equal megatron-core's, so
that a run serves the samples of a Megatron-LM run in the same order (test_mcore_sample_order.py
compares with megatron-core's output). Megatron-LM's choices, kept for that reason:

- one RandomState(seed) is drawn from in a fixed order: the document shuffle, then the sample
  shuffle; so the order depends on the number of samples requested (a run asked for more
  iterations sees other samples);
- all epochs' documents are shuffled together, except that a last epoch of which fewer than
  80% of its samples are needed is shuffled on its own, and its samples too: otherwise its
  few samples would be drawn from documents spread over every epoch;
- the dataset holds every whole sample of the laid-out epochs, usually more than requested.
"""

from __future__ import annotations

import numpy as np

# megatron-core shuffles a last epoch separately when less than this share of it is used.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Each sample reads seq_length + 1 tokens (megatron-core's add_extra_token_to_sequence).
_EXTRA_TOKEN = 1


def num_epochs_needed(*, num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """The fewest epochs whose tokens hold num_samples samples of seq_length + 1 tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; its documents are all empty")
    if num_samples < 1 or seq_length < 1:
        raise ValueError(f"num_samples and seq_length must be >= 1 ({num_samples}, {seq_length})")
    tokens_needed = num_samples * seq_length + _EXTRA_TOKEN
    return max(1, -(-tokens_needed // tokens_per_epoch))


def samples_in_epochs(num_epochs: int, *, tokens_per_epoch: int, seq_length: int) -> int:
    """Whole samples (seq_length + 1 tokens, one shared with the next) in num_epochs epochs."""
    return max(0, (num_epochs * tokens_per_epoch - _EXTRA_TOKEN) // seq_length)


def separate_final_epoch(
    *, num_samples: int, num_epochs: int, tokens_per_epoch: int, seq_length: int
) -> tuple[bool, int]:
    """(whether the last epoch is shuffled apart, samples before the last epoch)."""
    if num_epochs == 1:
        return False, 0
    before_last = samples_in_epochs(
        num_epochs - 1, tokens_per_epoch=tokens_per_epoch, seq_length=seq_length
    )
    per_epoch = samples_in_epochs(1, tokens_per_epoch=tokens_per_epoch, seq_length=seq_length)
    from_last = num_samples - before_last
    return from_last < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before_last


def build_document_index(
    document_ids: np.ndarray, *, num_epochs: int, separate_last: bool, rng: np.random.RandomState
) -> np.ndarray:
    """int32 document ids of num_epochs epochs, shuffled together (the last one apart)."""
    if separate_last and num_epochs > 1:
        leading = build_document_index(
            document_ids, num_epochs=num_epochs - 1, separate_last=False, rng=rng
        )
        last = build_document_index(document_ids, num_epochs=1, separate_last=False, rng=rng)
        return np.concatenate([leading, last])
    document_index = np.tile(np.asarray(document_ids, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


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
    if document_ends.size == 0 or positions[-1] >= document_ends[-1]:
        raise ValueError(
            f"the document index holds {int(document_ends[-1]) if document_ends.size else 0} "
            f"tokens, too few for {num_samples} samples of {seq_length} + 1 tokens"
        )
    holders = np.searchsorted(document_ends, positions, side="right")
    offsets = positions - (document_ends[holders] - document_lengths[holders])
    return np.stack([holders, offsets], axis=1).astype(np.int64)


def build_shuffle_index(
    *, num_samples: int, separate_from: int | None, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of range(num_samples); with separate_from, [0, separate_from) and
    [separate_from, num_samples) are permuted each within itself."""
    # megatron-core's dtypes; numpy's shuffle draws the same swaps for any dtype.
    dtype = np.uint32 if num_samples < np.iinfo(np.uint32).max - 1 else np.int64
    boundary = num_samples if separate_from is None else separate_from
    first = np.arange(boundary, dtype=dtype)
    rng.shuffle(first)
    if boundary == num_samples:
        return first
    last = np.arange(boundary, num_samples, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(
    *,
    document_ids: np.ndarray,
    sequence_lengths: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for at least num_samples samples."""
    tokens_per_epoch = int(np.asarray(sequence_lengths, dtype=np.int64)[document_ids].sum())
    num_epochs = num_epochs_needed(
        num_samples=num_samples, tokens_per_epoch=tokens_per_epoch, seq_length=seq_length
    )
    separate_last, before_last = separate_final_epoch(
        num_samples=num_samples,
        num_epochs=num_epochs,
        tokens_per_epoch=tokens_per_epoch,
        seq_length=seq_length,
    )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(
        document_ids, num_epochs=num_epochs, separate_last=separate_last, rng=rng
    )
    total_samples = samples_in_epochs(
        num_epochs, tokens_per_epoch=tokens_per_epoch, seq_length=seq_length
    )
    sample_index = build_sample_index(
        sequence_lengths=sequence_lengths,
        document_index=document_index,
        seq_length=seq_length,
        num_samples=total_samples,
    )
    shuffle_index = build_shuffle_index(
        num_samples=total_samples, separate_from=before_last if separate_last else None, rng=rng
    )
    return document_index, sample_index, shuffle_index
