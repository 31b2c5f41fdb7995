"""Megatron's memory-mapped .bin/.idx token format: writer and validating reader.

.idx layout (little-endian), as written by Megatron-LM:
    magic            9 bytes  b"MMIDIDX\\x00\\x00"
    version          uint64   1
    dtype code       uint8    see DTYPE_CODES
    sequence count   uint64   N
    document count   uint64   D = len(document_indices) (number of documents + 1, as Megatron-LM
                              writes it)
    sequence_lengths int32[N] tokens per sequence
    sequence_ptrs    int64[N] byte offset of each sequence in .bin
    document_indices int64[D] sequence index where each document starts, then N (starts at 0)
.bin is the token ids of all sequences back to back in the dtype of the header.
GPT pretraining writes one sequence per document.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Tokens per reduction of token_id_range: numpy checks for Ctrl-C only between calls, so one
# call over a 100 GB .bin could not be interrupted; 2**26 uint16 tokens take ~10 ms each.
_SCAN_CHUNK_TOKENS = 1 << 26
# <9s magic, Q version, B dtype code, Q sequence count, Q document count: 34 bytes in total.
HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_code(dtype: np.dtype | type[np.generic]) -> int:
    """The header code of a numpy dtype."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} cannot be stored in a .bin file")


def token_dtype_for_vocab(vocab_size: int) -> type[np.generic]:
    """The smallest dtype holding ids 0..vocab_size-1 (257-id byte vocab -> uint16)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    max_id = vocab_size - 1
    if max_id <= np.iinfo(np.uint8).max:
        return np.uint8
    if max_id <= np.iinfo(np.uint16).max:
        return np.uint16
    if max_id <= np.iinfo(np.int32).max:
        return np.int32
    return np.int64


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


class IndexedDatasetBuilder:
    """Streams documents into PREFIX.bin/.idx under temporary names; finalize() renames them.

    A reader never sees a half-written pair: both files appear only after everything is
    written (the .idx, renamed last, marks completion).
    """

    def __init__(self, path_prefix: str, *, dtype: type[np.generic]) -> None:
        self.path_prefix = path_prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = data_file_path(path_prefix) + suffix
        self._idx_tmp = index_file_path(path_prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")  # closed in finalize() or abort()
        self.sequence_lengths: list[int] = []
        self.num_tokens = 0
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._id_range = (int(info.min), int(info.max))
        else:
            self._id_range = None

    def add_document(self, token_ids: Any) -> None:
        """Append one document (one sequence) of token ids."""
        array = np.asarray(token_ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D list of token ids, got shape {array.shape}")
        if array.size and self._id_range is not None:
            low, high = int(array.min()), int(array.max())
            if low < self._id_range[0] or high > self._id_range[1]:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit the {self.dtype} of "
                    f"{self.path_prefix}.bin; the tokenizer's vocab_size is larger than declared"
                )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        self.num_tokens += int(array.size)

    def finalize(self) -> None:
        """Write the .idx and rename both files into place."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document has more than 2**31-1 tokens; split it before writing")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.arange(lengths.size + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as handle:
            handle.write(
                HEADER.pack(MAGIC, VERSION, self._code, lengths.size, document_indices.size)
            )
            handle.write(lengths.astype(np.int32).tobytes(order="C"))
            handle.write(pointers.tobytes(order="C"))
            handle.write(document_indices.tobytes(order="C"))
        os.replace(self._bin_tmp, data_file_path(self.path_prefix))
        os.replace(self._idx_tmp, index_file_path(self.path_prefix))

    def abort(self) -> None:
        """Close and delete the temporary files (after an error)."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)


def _prefix_hint(path_prefix: str) -> str:
    """What to pass instead: --data-path takes the prefix of a .bin/.idx pair."""
    for suffix in (".bin", ".idx"):
        if path_prefix.endswith(suffix) and os.path.isfile(path_prefix):
            return (
                f"--data-path takes the prefix without {suffix}: pass {path_prefix[: -len(suffix)]}"
            )
    if os.path.isdir(path_prefix):
        found = sorted(
            os.path.join(path_prefix, name[:-4])
            for name in os.listdir(path_prefix)
            if name.endswith(".idx")
        )
        listing = f" (prefixes there: {', '.join(found[:3])})" if found else ""
        return (
            f"{path_prefix} is a directory; --data-path takes the prefix of a .bin/.idx pair "
            f"inside it{listing}"
        )
    return f"create {path_prefix}.bin/.idx with tools/preprocess_data.py --output-prefix ..."


class CorruptIndexError(ValueError):
    """A .bin/.idx pair that is missing, truncated, corrupt, or does not belong together."""


def _read_header(idx_path: str) -> tuple[int, int, int, int]:
    """Validate the .idx header; return (dtype code, sequence count, document count, size)."""
    size = os.path.getsize(idx_path)
    if size < HEADER.size:
        raise CorruptIndexError(
            f"{idx_path} is truncated: {size} bytes, shorter than the {HEADER.size}-byte header; "
            "re-run tools/preprocess_data.py"
        )
    with open(idx_path, "rb") as handle:
        magic, version, code, num_sequences, num_documents = HEADER.unpack(handle.read(HEADER.size))
    if magic != MAGIC:
        raise CorruptIndexError(
            f"{idx_path} is not a Megatron .idx file: bad magic {magic!r} (expected {MAGIC!r})"
        )
    if version != VERSION:
        raise CorruptIndexError(
            f"{idx_path} has unsupported version {version} (this reader knows version {VERSION})"
        )
    if code not in DTYPE_CODES:
        raise CorruptIndexError(
            f"{idx_path} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)})"
        )
    expected = HEADER.size + num_sequences * (4 + 8) + num_documents * 8
    if size != expected:
        raise CorruptIndexError(
            f"{idx_path} is {size} bytes but its header ({num_sequences} sequences, "
            f"{num_documents} document indices) implies {expected} bytes: the file is truncated "
            "or corrupt; re-run tools/preprocess_data.py"
        )
    return code, num_sequences, num_documents, size


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin/.idx, validated when opened.

    Sequence i is `self[i]` (a numpy view, no copy); `get(i, offset, length)` reads a slice.
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self.idx_path = index_file_path(path_prefix)
        self.bin_path = data_file_path(path_prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"data file {path} does not exist; {_prefix_hint(path_prefix)}"
                )
        self._open()

    def _open(self) -> None:
        code, num_sequences, num_documents, _ = _read_header(self.idx_path)
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = HEADER.size
        self.sequence_lengths = self._map_idx(np.int32, offset, num_sequences)
        offset += 4 * num_sequences
        self.sequence_pointers = self._map_idx(np.int64, offset, num_sequences)
        offset += 8 * num_sequences
        self.document_indices = self._map_idx(np.int64, offset, num_documents)
        self._validate_index(num_sequences, num_documents)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(self.bin_path)
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise CorruptIndexError(
                f"{self.bin_path} is {bin_size} bytes but {self.idx_path} describes "
                f"{self.num_tokens} tokens of {self.dtype} ({self.num_tokens * self.dtype.itemsize}"
                " bytes): the .bin is truncated or belongs to another .idx; re-run "
                "tools/preprocess_data.py"
            )
        if self.num_tokens == 0:
            raise CorruptIndexError(f"{self.bin_path} holds no tokens: the corpus is empty")
        self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def _map_idx(self, dtype: type[np.generic], offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    def _validate_index(self, num_sequences: int, num_documents: int) -> None:
        lengths, pointers, documents = (
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
        )
        problem = None
        if num_documents < 1 or documents[0] != 0 or documents[-1] != num_sequences:
            problem = f"document_indices must start at 0 and end at {num_sequences}"
        elif np.any(np.diff(documents) < 0):
            problem = "document_indices are not non-decreasing"
        elif num_sequences and lengths.min() < 0:
            problem = "a sequence length is negative"
        elif num_sequences and (
            pointers[0] != 0
            or np.any(np.diff(pointers) != lengths[:-1].astype(np.int64) * self.dtype.itemsize)
        ):
            problem = "sequence pointers do not match the sequence lengths"
        if problem is not None:
            raise CorruptIndexError(
                f"{self.idx_path} is corrupt: {problem}; re-run tools/preprocess_data.py"
            )

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def get(self, index: int, *, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `index` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"slice [{offset}, {offset + length}) is outside sequence {index} of {size} tokens"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def token_id_range(self, *, chunk_tokens: int = _SCAN_CHUNK_TOKENS) -> tuple[int, int]:
        """The exact smallest and largest token id in the .bin: one read of every token, in
        chunks of `chunk_tokens`."""
        lows, highs = [], []
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = self._tokens[start : start + chunk_tokens]
            lows.append(chunk.min())
            highs.append(chunk.max())
        # int() truncates float tokens toward zero, as build_item's cast to int64 does.
        return int(min(lows)), int(max(highs))

    # Memory maps would be pickled by copying their data into DataLoader workers; reopen instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path_prefix"])
