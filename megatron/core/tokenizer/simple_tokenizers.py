"""Tokenizers that need no files: raw UTF-8 bytes, and integer ids for mock data."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.tokenizer.base import check_token_ids

# 256 byte values plus one end-of-document id.
_NUM_BYTES = 256


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and an end-of-document id 256 (vocab_size 257).

    The default tokenizer: needs no files and round-trips any text exactly.
    """

    def __init__(self) -> None:
        self.vocab_size: int = _NUM_BYTES + 1
        self.eod: int = _NUM_BYTES

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name="ByteTokenizer")
        # End-of-document ids carry no text. A sample can cut a multi-byte character in half,
        # so undecodable bytes become U+FFFD instead of failing.
        data = bytes(token_id for token_id in token_ids if token_id != self.eod)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eod=256)"


class NullTokenizer:
    """Text is whitespace-separated integer ids (as Megatron's NullTokenizer); eod = vocab_size-1.

    Used with mock data and for preprocessing corpora that are already tokenized.
    """

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(
                f"NullTokenizer needs --vocab-size >= 2 (one id is the end-of-document id), "
                f"got {vocab_size!r}"
            )
        self.vocab_size: int = vocab_size
        self.eod: int = vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            token_ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise ValueError(
                "NullTokenizer reads whitespace-separated integer ids; the text contains a "
                f"non-integer word ({error}). Use --tokenizer-type ByteTokenizer for raw text"
            ) from error
        return check_token_ids(token_ids, vocab_size=self.vocab_size, name="NullTokenizer")

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name="NullTokenizer")
        return " ".join(str(token_id) for token_id in token_ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
