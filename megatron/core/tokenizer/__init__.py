"""Tokenizers: byte-level (default), null (mock data), HuggingFace tokenizer.json, GPT-2 BPE,
tiktoken (TikTokenizer) and SentencePiece models."""

from megatron.core.tokenizer.base import Tokenizer
from megatron.core.tokenizer.build import TOKENIZER_TYPES, build_tokenizer
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizer.simple_tokenizers import ByteTokenizer, NullTokenizer
from megatron.core.tokenizer.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "ByteTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "build_tokenizer",
]
