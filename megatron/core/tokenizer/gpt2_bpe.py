"""GPT-2 byte-level BPE from local vocab.json and merges.txt files (never downloads).

Algorithm (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"):
text is split into pre-tokens by a regex, each pre-token's UTF-8 bytes are mapped to printable
characters, then the lowest-ranked adjacent pair from merges.txt is merged until no listed
pair remains, and each resulting symbol is looked up in vocab.json.

Two encoders give the same ids: the optional `tiktoken` package (Rust, about 7x faster; see
gpt2_bpe_tiktoken.py for when it applies), used when installed, and the pure-Python encoder
below, the fallback. tests/unit_tests/data/test_gpt2_bpe_fast.py compares them on varied text;
benchmarks/preprocess_gpt2bpe.py measures the difference.
"""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron.core.tokenizer import gpt2_bpe_tiktoken
from megatron.core.tokenizer.base import check_token_ids

EOD_TOKEN = "<|endoftext|>"

# No letters or numbers are assigned above plane 3 (planes 4-13 are empty, 14 holds tags and
# variation selectors, 15-16 are private use), so scanning to U+3FFFF covers \p{L} and \p{N}.
_LAST_SCANNED_CODE_POINT = 0x3FFFF
# U+3000 (ideographic space) is the last code point str.isspace() accepts.
_LAST_WHITESPACE_CODE_POINT = 0x3000


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Bytes that are already printable (and not whitespace) map to themselves; the other 68 map,
    in increasing order, to U+0100 and up, so that no BPE symbol contains whitespace or
    control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(next_code_point)
            next_code_point += 1
    return mapping


def _category_class(prefix: str) -> str:
    """A regex character class body matching every code point whose category starts with prefix.

    Python's `re` has no \\p{L}/\\p{N}; this builds the exact ranges from unicodedata.
    """
    ranges: list[tuple[int, int]] = []
    for code_point in range(_LAST_SCANNED_CODE_POINT + 1):
        if unicodedata.category(chr(code_point)).startswith(prefix):
            if ranges and ranges[-1][1] == code_point - 1:
                ranges[-1] = (ranges[-1][0], code_point)
            else:
                ranges.append((code_point, code_point))
    parts = []
    for first, last in ranges:
        if first == last:
            parts.append(re.escape(chr(first)))
        else:
            parts.append(f"{re.escape(chr(first))}-{re.escape(chr(last))}")
    return "".join(parts)


def _whitespace_class() -> str:
    """Unicode White_Space as a character class body: Python's \\s less U+001C..U+001F.

    Python's `re` counts the four information separators as whitespace (str.isspace); GPT-2's
    reference encoder (the `regex` module) and the `tokenizers` package do not.
    """
    return "".join(
        re.escape(chr(code_point))
        for code_point in range(_LAST_WHITESPACE_CODE_POINT + 1)
        if chr(code_point).isspace() and not 0x1C <= code_point <= 0x1F
    )


@functools.lru_cache(maxsize=1)
def gpt2_pretokenizer() -> re.Pattern[str]:
    """GPT-2's split pattern with \\p{L} (letters), \\p{N} (numbers) and \\s (Unicode
    whitespace) spelled out as ranges."""
    letters = _category_class("L")
    numbers = _category_class("N")
    space = _whitespace_class()
    pattern = (
        r"'s|'t|'re|'ve|'m|'ll|'d"
        rf"| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )
    return re.compile(pattern)


def _read_file(path: str, *, flag: str, kind: str, usual_name: str) -> bytes:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"GPT-2 {kind} file {path!r} does not exist; pass the local {usual_name} "
            f"with {flag} (nothing is downloaded)"
        )
    with open(path, "rb") as handle:
        return handle.read()


def _parse_vocab(data: bytes, vocab_file: str) -> dict[str, int]:
    try:
        vocab = json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--vocab-file {vocab_file!r} is not valid JSON ({error}); it must map token "
            "strings to ids like GPT-2's vocab.json"
        ) from error
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file!r} must be a JSON object of token -> int id")
    return vocab


def _parse_merges(data: bytes, merge_file: str) -> dict[tuple[str, str], int]:
    ranks: dict[tuple[str, str], int] = {}
    # Universal newlines, as a text-mode open() reads them.
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"--merge-file {merge_file!r} line {line_number}: expected two symbols "
                f"separated by one space, got {line!r}"
            )
        ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


# Encoders GPT2BPETokenizer can use: "auto" takes tiktoken when it can, else "python".
ENCODERS = ("auto", "tiktoken", "python")


class GPT2BPETokenizer:
    """Byte-level BPE over a local GPT-2 style vocab.json + merges.txt; eod is <|endoftext|>.

    encoder: "auto" (the `tiktoken` package when installed and the files suit it, else pure
    Python), "tiktoken" (required: ImportError/ValueError otherwise) or "python". Both give the
    same ids. The tiktoken tables are built (and the files checked) on first use, or read from
    the cache of checked files (gpt2_bpe_tiktoken.py).
    """

    def __init__(self, vocab_file: str, merge_file: str, *, encoder: str = "auto") -> None:
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
        vocab_data = _read_file(
            vocab_file, flag="--vocab-file", kind="vocabulary", usual_name="vocab.json"
        )
        merges_data = _read_file(
            merge_file, flag="--merge-file", kind="merges", usual_name="merges.txt"
        )
        self.encoder = _parse_vocab(vocab_data, vocab_file)
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        # Keys the on-disk cache of the checked tiktoken tables (gpt2_bpe_tiktoken.py).
        self._files_digest = gpt2_bpe_tiktoken.files_digest(vocab_data, merges_data)
        self._merge_file = merge_file
        self._merges_data: bytes | None = merges_data
        self._bpe_ranks: dict[tuple[str, str], int] | None = None
        self._cached_tables: gpt2_bpe_tiktoken.Tables | None = None
        if encoder != "python":
            self._cached_tables = gpt2_bpe_tiktoken.load_cached_tables(self._files_digest)
        if self._cached_tables is None:
            # Parsed now so that a malformed merges.txt fails here; files with cached tables
            # parsed and passed the check before, so only the Python encoder needs the merges.
            self._parse_merges_now()
        if EOD_TOKEN not in self.encoder:
            raise ValueError(
                f"--vocab-file {vocab_file!r} has no {EOD_TOKEN!r} entry, which GPT-2 BPE uses "
                "as the end-of-document id"
            )
        self.eod: int = self.encoder[EOD_TOKEN]
        self.vocab_size: int = max(self.encoder.values()) + 1
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self._vocab_file = vocab_file
        # Pre-tokens repeat heavily in natural text; memoizing their merges is the main speedup.
        self._cache: dict[str, tuple[str, ...]] = {}
        self._requested_encoder = encoder
        self._tiktoken_tables: tuple[dict[bytes, int], np.ndarray | None] | None = None
        self._fast: Any = None
        self._resolved = encoder == "python"

    def _parse_merges_now(self) -> None:
        self._bpe_ranks = _parse_merges(self._merges_data, self._merge_file)
        self._merges_data = None

    @property
    def bpe_ranks(self) -> dict[tuple[str, str], int]:
        """merges.txt as {(left, right): rank}."""
        if self._bpe_ranks is None:
            self._parse_merges_now()
        return self._bpe_ranks

    def _resolve_encoder(self) -> None:
        """Build the tiktoken encoder once, unless the Python one was asked for or must do."""
        self._resolved = True
        if not gpt2_bpe_tiktoken.tiktoken_available():
            if self._requested_encoder == "tiktoken":
                raise ImportError(
                    "GPT2BPETokenizer(encoder='tiktoken') needs the optional `tiktoken` "
                    "package: pip install tiktoken"
                )
            return
        self._tiktoken_tables, self._cached_tables = self._cached_tables, None
        if self._tiktoken_tables is None:
            self._tiktoken_tables = gpt2_bpe_tiktoken.build_tables(
                encoder=self.encoder,
                bpe_ranks=self.bpe_ranks,
                byte_encoder=self.byte_encoder,
                classic_bpe=self._bpe,
            )
            if self._tiktoken_tables is not None:
                gpt2_bpe_tiktoken.store_tables(self._files_digest, self._tiktoken_tables)
        if self._tiktoken_tables is None:
            if self._requested_encoder == "tiktoken":
                raise ValueError(
                    f"--vocab-file {self._vocab_file!r} and its merges do not suit tiktoken "
                    "(see megatron/core/tokenizer/gpt2_bpe_tiktoken.py); use encoder='python'"
                )
            return
        self._fast = gpt2_bpe_tiktoken.make_encoding(self._tiktoken_tables[0])

    @property
    def encoder_name(self) -> str:
        """'tiktoken' or 'python': the encoder tokenize() uses (resolving it now)."""
        if not self._resolved:
            self._resolve_encoder()
        return "python" if self._fast is None else "tiktoken"

    @property
    def tokenize_releases_gil(self) -> bool:
        """True when tokenize() runs in tiktoken's Rust code without the GIL, so threads of one
        process encode in parallel (tools/preprocess_data.py then runs --workers 2 as threads)."""
        return self.encoder_name == "tiktoken"

    def __getstate__(self) -> dict[str, Any]:
        # Preprocessing workers get the checked tables and rebuild the Rust object from them.
        state = dict(self.__dict__)
        state["_fast"] = None
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._tiktoken_tables is not None:
            self._fast = gpt2_bpe_tiktoken.make_encoding(self._tiktoken_tables[0])

    def _bpe(self, pretoken: str) -> tuple[str, ...]:
        cached = self._cache.get(pretoken)
        if cached is not None:
            return cached
        bpe_ranks = self.bpe_ranks
        unranked = len(bpe_ranks)
        symbols = list(pretoken)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: bpe_ranks.get(pair, unranked))
            if best not in bpe_ranks:
                break
            merged: list[str] = []
            index = 0
            while index < len(symbols):
                # Merge every occurrence, left to right, without overlaps.
                if index + 1 < len(symbols) and (symbols[index], symbols[index + 1]) == best:
                    merged.append(symbols[index] + symbols[index + 1])
                    index += 2
                else:
                    merged.append(symbols[index])
                    index += 1
            symbols = merged
        result = tuple(symbols)
        self._cache[pretoken] = result
        return result

    def tokenize(self, text: str) -> list[int]:
        if not self._resolved:
            self._resolve_encoder()
        if self._fast is not None:
            ranks = self._fast.encode_ordinary(text)
            rank_to_id = self._tiktoken_tables[1]
            return ranks if rank_to_id is None else rank_to_id[ranks].tolist()
        return self.tokenize_python(text)

    def tokenize_python(self, text: str) -> list[int]:
        """The pure-Python encoder (the fallback), whatever encoder is in use."""
        token_ids: list[int] = []
        for pretoken in gpt2_pretokenizer().findall(text):
            mapped = "".join(self.byte_encoder[byte] for byte in pretoken.encode("utf-8"))
            for symbol in self._bpe(mapped):
                token_id = self.encoder.get(symbol)
                if token_id is None:
                    raise ValueError(
                        f"BPE symbol {symbol!r} is missing from --vocab-file "
                        f"{self._vocab_file!r}; vocab.json and merges.txt do not belong together"
                    )
                token_ids.append(token_id)
        return token_ids

    def detokenize(self, ids: Sequence[int]) -> str:
        token_ids = check_token_ids(ids, vocab_size=self.vocab_size, name="GPT2BPETokenizer")
        missing = [token_id for token_id in token_ids if token_id not in self.decoder]
        if missing:
            raise ValueError(
                f"token ids {missing[:5]} have no entry in --vocab-file {self._vocab_file!r}"
            )
        text = "".join(self.decoder[token_id] for token_id in token_ids)
        data = bytes(self.byte_decoder[char] for char in text if char in self.byte_decoder)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (
            f"GPT2BPETokenizer(vocab_size={self.vocab_size}, eod={self.eod}, "
            f"encoder={self.encoder_name})"
        )
