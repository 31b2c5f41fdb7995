"""Megatron-LM's TikTokenizer: a tiktoken BPE from a local JSON vocabulary (optional `tiktoken`).

--tokenizer-model is a JSON list of {"rank", "token_bytes" (base64), "token_str"} entries, rank
equal to the position, the first 256 being the single bytes in order (the format of NeMo and
Megatron-LM's Nemotron vocabularies). As in Megatron-LM:

- ids 0..num_special_tokens-1 are special tokens: --tiktoken-special-tokens (default <unk>, <s>,
  </s>; these three must be among them), then fillers <SPECIAL_k> up to the count;
- the vocabulary entries follow with id = rank + num_special_tokens, cut to
  vocab_size - num_special_tokens entries (vocab_size: --vocab-size, default 2**17);
- eod is </s>; special tokens written in text are encoded as plain text.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from typing import Any

from megatron.core.tokenizer.base import check_token_ids

# Megatron-LM's --tiktoken-pattern v1 and v2 split regexes (facts of its tokenizer, unchanged).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
DEFAULT_VOCAB_SIZE = 2**17  # Megatron-LM's fallback when --vocab-size is not given
DEFAULT_NUM_SPECIAL_TOKENS = 1000


def read_tiktoken_vocab(path: str, *, max_entries: int) -> dict[bytes, int]:
    """token bytes -> rank of the first max_entries entries of a Megatron/NeMo JSON vocab."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"TikTokenizer vocabulary {path!r} does not exist; pass the local JSON file with "
            "--tokenizer-model (nothing is downloaded)"
        )
    with open(path, encoding="utf-8") as handle:
        try:
            entries = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"--tokenizer-model {path!r} is not valid JSON ({error})") from error
    if not isinstance(entries, list):
        raise ValueError(
            f"--tokenizer-model {path!r} must be a JSON list of "
            '{"rank", "token_bytes", "token_str"} entries for TikTokenizer'
        )
    ranks: dict[bytes, int] = {}
    for position, entry in enumerate(entries[:max_entries]):
        if not isinstance(entry, dict) or entry.get("rank") != position:
            raise ValueError(
                f"--tokenizer-model {path!r} entry {position} must be an object with "
                f'"rank": {position}, "token_bytes" and "token_str"'
            )
        token = base64.b64decode(entry["token_bytes"])
        if position < 256 and token != bytes([position]):
            raise ValueError(
                f"--tokenizer-model {path!r} entry {position} must be the single byte "
                f"{position}: the first 256 entries are the bytes in order"
            )
        if token in ranks:
            raise ValueError(f"--tokenizer-model {path!r} repeats token {token!r}")
        ranks[token] = position
    return ranks


class TikTokenizer:
    """--tokenizer-type TikTokenizer with Megatron-LM's special-token layout (module docstring)."""

    # tiktoken encodes in Rust without the GIL: tools/preprocess_data.py runs --workers 2 as
    # threads of one process.
    tokenize_releases_gil = True

    def __init__(
        self,
        path: str,
        *,
        pattern: str,
        vocab_size: int | None = None,
        num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens: Sequence[str] | None = None,
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ImportError(
                "--tokenizer-type TikTokenizer needs the optional `tiktoken` package: "
                "pip install tiktoken"
            ) from None
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        self.vocab_size: int = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        specials = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(specials)) != len(specials):
            raise ValueError(f"--tiktoken-special-tokens repeat a token: {specials}")
        if not set(REQUIRED_SPECIAL_TOKENS) <= set(specials):
            raise ValueError(
                f"--tiktoken-special-tokens {specials} must include {list(REQUIRED_SPECIAL_TOKENS)}"
            )
        if not len(specials) <= num_special_tokens < self.vocab_size:
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                f"{len(specials)} special tokens and below the vocabulary size {self.vocab_size}"
            )
        specials += [f"<SPECIAL_{index}>" for index in range(len(specials), num_special_tokens)]
        ranks = read_tiktoken_vocab(path, max_entries=self.vocab_size - num_special_tokens)
        if len(ranks) + num_special_tokens != self.vocab_size:
            raise ValueError(
                f"--tokenizer-model {path!r} holds {len(ranks)} tokens, but --vocab-size "
                f"{self.vocab_size} with {num_special_tokens} special tokens needs "
                f"{self.vocab_size - num_special_tokens}; pass --vocab-size "
                f"{len(ranks) + num_special_tokens} or less"
            )
        self.path, self.pattern, self.num_special_tokens = path, pattern, num_special_tokens
        self.special_tokens = {token: index for index, token in enumerate(specials)}
        self.mergeable_ranks = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self.eod: int = self.special_tokens["</s>"]
        self.bos: int = self.special_tokens["<s>"]
        self.unk: int = self.special_tokens["<unk>"]
        self._model = self._build_model(tiktoken)

    def _build_model(self, tiktoken: Any) -> Any:
        return tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(self.path))) or "tiktoken",
            pat_str=TIKTOKEN_PATTERNS[self.pattern],
            mergeable_ranks=self.mergeable_ranks,
            special_tokens=self.special_tokens,
        )

    def __getstate__(self) -> dict[str, Any]:
        # Preprocessing workers rebuild the Rust encoder from the tables.
        return {key: value for key, value in self.__dict__.items() if key != "_model"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import tiktoken

        self.__dict__.update(state)
        self._model = self._build_model(tiktoken)

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name="TikTokenizer")
        return self._model.decode(token_ids)

    def __repr__(self) -> str:
        return (
            f"TikTokenizer(vocab_size={self.vocab_size}, eod={self.eod}, "
            f"pattern={self.pattern}, num_special_tokens={self.num_special_tokens})"
        )
