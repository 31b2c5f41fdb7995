"""The interface every tokenizer in megatron-fp8 satisfies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What preprocessing, datasets and generation need from a tokenizer.

    `vocab_size` is the number of ids the tokenizer can emit (before any padding the model
    applies); `eod` is the id appended after each document.
    """

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


def check_token_ids(ids: Sequence[int], *, vocab_size: int, name: str) -> list[int]:
    """Return ids as plain ints, raising when one is outside [0, vocab_size)."""
    token_ids = [int(token_id) for token_id in ids]
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{name}: token id {token_id} is outside the vocabulary [0, {vocab_size}); "
                "the ids were produced by a different tokenizer"
            )
    return token_ids
