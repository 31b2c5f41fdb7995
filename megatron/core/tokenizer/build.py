"""Build a tokenizer by Megatron's --tokenizer-type name."""

from __future__ import annotations

from megatron.core.tokenizer.base import Tokenizer
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizer.simple_tokenizers import ByteTokenizer, NullTokenizer
from megatron.core.tokenizer.tiktoken_tokenizer import DEFAULT_NUM_SPECIAL_TOKENS, TikTokenizer

TOKENIZER_TYPES = (
    "ByteTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
)


def _require(value: str | int | None, *, flag: str, tokenizer_type: str) -> None:
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")


def build_tokenizer(
    *,
    tokenizer_type: str,
    vocab_size: int | None = None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
    tiktoken_special_tokens: list[str] | None = None,
) -> Tokenizer:
    """Return the tokenizer named by tokenizer_type; file arguments are local paths only.

    ByteTokenizer needs nothing; NullTokenizer needs vocab_size (--vocab-size);
    HuggingFaceTokenizer needs tokenizer_model (--tokenizer-model, a tokenizer.json or its
    directory); GPT2BPETokenizer needs vocab_file and merge_file (--vocab-file, --merge-file);
    TikTokenizer needs tokenizer_model (a JSON vocabulary) and tiktoken_pattern (v1/v2), and
    takes vocab_size (default 2**17) and the special-token flags; SentencePieceTokenizer and
    GPTSentencePieceTokenizer need tokenizer_model (a SentencePiece .model file).
    """
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        _require(vocab_size, flag="--vocab-size", tokenizer_type=tokenizer_type)
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        _require(tokenizer_model, flag="--tokenizer-model", tokenizer_type=tokenizer_type)
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        _require(vocab_file, flag="--vocab-file", tokenizer_type=tokenizer_type)
        _require(merge_file, flag="--merge-file", tokenizer_type=tokenizer_type)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "TikTokenizer":
        _require(tokenizer_model, flag="--tokenizer-model", tokenizer_type=tokenizer_type)
        _require(tiktoken_pattern, flag="--tiktoken-pattern", tokenizer_type=tokenizer_type)
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=tiktoken_special_tokens,
        )
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        _require(tokenizer_model, flag="--tokenizer-model", tokenizer_type=tokenizer_type)
        if tokenizer_type == "SentencePieceTokenizer":
            return SentencePieceTokenizer(tokenizer_model)
        return GPTSentencePieceTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
