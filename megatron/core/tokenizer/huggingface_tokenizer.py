"""A tokenizer loaded from a local HuggingFace `tokenizer.json` (optional `tokenizers` package)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from megatron.core.tokenizer.base import check_token_ids

# Tried in order when no tokenizer_config.json names the end-of-sequence token.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


def _resolve_tokenizer_json(tokenizer_model: str) -> str:
    """Accept either the tokenizer.json file or the directory that holds it."""
    path = tokenizer_model
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"HuggingFace tokenizer file {path!r} does not exist; pass a local tokenizer.json "
            "(or the directory holding it) with --tokenizer-model (nothing is downloaded)"
        )
    return path


def _eos_from_config(tokenizer_json: str) -> str | None:
    """The eos_token declared in a tokenizer_config.json next to tokenizer.json, if any."""
    config_path = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialized as a dict
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HuggingFaceTokenizer:
    """Wraps `tokenizers.Tokenizer.from_file`; eod is the end-of-sequence token.

    The eod token comes from tokenizer_config.json's eos_token when that file sits next to
    tokenizer.json, otherwise from the first of the usual end-of-text tokens in the vocabulary.
    """

    def __init__(self, tokenizer_model: str) -> None:
        try:
            import tokenizers
        except ImportError as error:
            raise ImportError(
                "--tokenizer-type HuggingFaceTokenizer needs the optional `tokenizers` package: "
                "pip install tokenizers"
            ) from error
        path = _resolve_tokenizer_json(tokenizer_model)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as error:  # tokenizers raises its own Exception subclass
            raise ValueError(
                f"--tokenizer-model {path!r} could not be parsed as a tokenizer.json: {error}"
            ) from error
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = [_eos_from_config(path), *_EOD_CANDIDATES]
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token) if token else None
            if token_id is not None:
                self.eod: int = token_id
                self.eod_token: str = token
                break
        else:
            raise ValueError(
                f"--tokenizer-model {path!r} has no end-of-document token: none of "
                f"{list(_EOD_CANDIDATES)} is in its vocabulary and no tokenizer_config.json "
                "next to it names an eos_token"
            )

    def tokenize(self, text: str) -> list[int]:
        # Preprocessing appends eod itself; special tokens such as BOS are not wanted mid-corpus.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name="HuggingFaceTokenizer")
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
