"""The tokenizer of an HF export: the one the checkpoint was trained with (its metadata.json
args), written so that transformers.AutoTokenizer loads it and maps text to the same ids.

- ByteTokenizer: ids are the UTF-8 bytes 0..255 and 256 is <|endoftext|>. Written as a
  byte-level BPE without merges whose 256 base symbols are GPT-2's printable stand-ins for the
  bytes, in byte order, so each byte becomes the id equal to its value.
- GPT2BPETokenizer: the run's own vocab.json and merges.txt, as GPT2TokenizerFast.
Other tokenizers (NullTokenizer's ids have no text; TikToken and SentencePiece files are the
user's) are not written: the export says so, and which tokenizer the ids belong to.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode
from megatron.training import checkpoint as checkpointing

EOD = "<|endoftext|>"
# What a tokenizer write may add to an export directory (a re-export may replace them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def _save_byte_level(model, directory: str, *, use_regex: bool) -> None:
    """A byte-level BPE `model` with GPT-2's pre-tokenizer and decoder, as a fast tokenizer
    whose <|endoftext|> is one special token (built from `tokenizers` parts, which every
    transformers version loads the same way)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOD, special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOD, bos_token=EOD)
    fast.save_pretrained(directory)


def _write_byte_tokenizer(directory: str) -> None:
    from tokenizers import models

    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    vocab[EOD] = 256
    # No merges and no pre-split: every byte is its own token, id = byte value.
    _save_byte_level(models.BPE(vocab=vocab, merges=[]), directory, use_regex=False)


def _gpt2_writer(saved: dict) -> Callable[[str], None]:
    vocab_file, merge_file = saved.get("vocab_file"), saved.get("merge_file")
    for path in (vocab_file, merge_file):
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(
                f"the checkpoint's GPT2BPETokenizer file {path!r} is not there; the export "
                "needs the run's --vocab-file and --merge-file to write its tokenizer"
            )

    def write(directory: str) -> None:
        from tokenizers import models

        _save_byte_level(models.BPE.from_file(vocab_file, merge_file), directory, use_regex=True)

    return write


def _require_tokenizer_packages() -> None:
    """The tokenizer files are written with `tokenizers` and `transformers`: checked before
    anything of the export is written."""
    missing = [n for n in ("tokenizers", "transformers") if importlib.util.find_spec(n) is None]
    if missing:
        raise ImportError(
            f"HuggingFace export of the tokenizer needs {' and '.join(missing)}: run "
            '`pip install transformers safetensors` (or `pip install -e ".[hf]"`)'
        )


def tokenizer_writer(saved: dict) -> tuple[Callable[[str], None] | None, str]:
    """(a function writing the tokenizer into a directory, or None; what the export says)."""
    kind = saved.get("tokenizer_type")
    if kind in ("ByteTokenizer", "GPT2BPETokenizer"):
        _require_tokenizer_packages()
    if kind == "ByteTokenizer":
        return _write_byte_tokenizer, f"tokenizer: byte-level (ids = UTF-8 bytes, 256 = {EOD})"
    if kind == "GPT2BPETokenizer":
        return _gpt2_writer(saved), "tokenizer: GPT-2 BPE (the run's vocab.json and merges.txt)"
    return None, (
        f"no tokenizer written: the ids are --tokenizer-type {kind}'s; load that tokenizer "
        "yourself (only ByteTokenizer and GPT2BPETokenizer are exported)"
    )


def saved_args(load_dir: str, iteration: int | None) -> dict:
    """The training flags recorded in the exported checkpoint's metadata.json."""
    directory = load_dir
    if not os.path.isfile(os.path.join(load_dir, "metadata.json")):
        step = iteration if iteration is not None else checkpointing.read_tracker(load_dir)
        directory = checkpointing.resolve_iteration_dir(load_dir, step)
    return checkpointing.read_metadata(directory).get("args", {})
