"""Megatron-LM's SentencePiece tokenizers from a local .model file (optional `sentencepiece`).

- GPTSentencePieceTokenizer: the model's own ids (vocab_size = its piece count), eod = the
  model's eos id; text is encoded as is.
- SentencePieceTokenizer: Megatron-LM's general wrapper: <CLS>, <SEP>, <EOD>, <MASK> and the
  model's pad/bos/eos pieces (or <PAD>/<BOS>/<EOS> when the model has none) are special tokens,
  appended after the model's pieces when the model lacks them (so vocab_size can exceed the piece
  count); eod is <EOD>; a special token written in the text is encoded as its id.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megatron.core.tokenizer.base import check_token_ids


def _load_processor(model_file: str, tokenizer_type: str) -> Any:
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(
            f"--tokenizer-type {tokenizer_type} needs the optional `sentencepiece` package: "
            "pip install sentencepiece"
        ) from None
    if not os.path.isfile(model_file):
        raise FileNotFoundError(
            f"SentencePiece model {model_file!r} does not exist; pass the local .model file "
            "with --tokenizer-model (nothing is downloaded)"
        )
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as error:
        raise ValueError(
            f"--tokenizer-model {model_file!r} is not a SentencePiece model ({error})"
        ) from error


class GPTSentencePieceTokenizer:
    """The SentencePiece model's own ids; eod is its eos id (as Megatron-LM's)."""

    tokenizer_type = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self._processor = _load_processor(model_file, self.tokenizer_type)
        self.vocab_size: int = self._processor.get_piece_size()
        self.eod: int = self._processor.eos_id()
        if not 0 <= self.eod < self.vocab_size:
            raise ValueError(
                f"--tokenizer-model {model_file!r} has no end-of-sentence piece (eos_id "
                f"{self.eod}); {self.tokenizer_type} uses it as the end-of-document id"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {"model_file": self.model_file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_file"])

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name=self.tokenizer_type)
        return self._processor.decode_ids(token_ids)

    def __repr__(self) -> str:
        return f"{self.tokenizer_type}(vocab_size={self.vocab_size}, eod={self.eod})"


class SentencePieceTokenizer:
    """Megatron-LM's SentencePieceTokenizer: special tokens added after the model's pieces."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self._processor = _load_processor(model_file, self.tokenizer_type)
        processor = self._processor
        self.vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
        self.special_tokens: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special_token(token)
        # The model's pad/bos/eos pieces, or Megatron-LM's names when the model has none (-1).
        for model_id, fallback in (
            (processor.pad_id(), "<PAD>"),
            (processor.bos_id(), "<BOS>"),
            (processor.eos_id(), "<EOS>"),
        ):
            in_model = 0 <= model_id < processor.get_piece_size()
            self._add_special_token(processor.id_to_piece(model_id) if in_model else fallback)
        self.id_to_special = {token_id: token for token, token_id in self.special_tokens.items()}
        self.vocab_size: int = len(self.vocab)
        self.eod: int = self.special_tokens["<EOD>"]

    def _add_special_token(self, token: str) -> None:
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
        self.special_tokens[token] = self.vocab[token]

    def __getstate__(self) -> dict[str, Any]:
        return {"model_file": self.model_file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_file"])

    def tokenize(self, text: str) -> list[int]:
        """The model's ids, with each special token found in the text (earliest first) as its
        own id, as Megatron-LM does."""
        ids: list[int] = []
        start = 0
        while True:
            found = [
                (position, token)
                for token in self.special_tokens
                if (position := text.find(token, start)) >= 0
            ]
            if not found:
                break
            # Earliest occurrence; on a tie the token listed first (dict order), as Megatron-LM.
            position, token = min(found, key=lambda item: item[0])
            ids += self._processor.encode_as_ids(text[start:position])
            ids.append(self.special_tokens[token])
            start = position + len(token)
        ids += self._processor.encode_as_ids(text[start:])
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron-LM's decoding: a special token is written with a space on each side."""
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name=self.tokenizer_type)
        text, last = "", 0
        for index, token_id in enumerate(token_ids):
            if token_id in self.id_to_special:
                text += self._processor.decode_ids(token_ids[last:index]) + " "
                text += self.id_to_special[token_id] + " "
                last = index + 1
        return text + self._processor.decode_ids(token_ids[last:])

    def __repr__(self) -> str:
        return f"{self.tokenizer_type}(vocab_size={self.vocab_size}, eod={self.eod})"
