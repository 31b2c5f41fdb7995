"""Tokenize raw text into Megatron .bin/.idx files (one sequence per document).

    python3 tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type ByteTokenizer --append-eod --workers 2

--input takes JSONL files (.jsonl/.json, one JSON object per line), plain text files (each file
one document), directories (every file below, sorted) or globs. Each JSON key K is written to
OUTPUT_PREFIX_K_document.bin/.idx; plain text files feed the key "text".
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):
    # Run as `python3 tools/preprocess_data.py`: make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":
    # Preprocessing does no linear algebra, yet importing numpy starts an OpenBLAS thread per
    # core: 0.06 CPU s of each run (and of each spawned worker, which inherits this) on the
    # 2-core machine. Only when run as a script: a program importing this module keeps its BLAS.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    token_dtype_for_vocab,
)
from megatron.core.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer  # noqa: E402

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_KEY = "text"
_GLOB_CHARACTERS = set("*?[")

# Documents per chunk handed to a thread, and chunks per thread queued ahead of the writer:
# enough to keep both cores busy between the writer's turns, few enough to bound memory.
_THREAD_CHUNK_DOCUMENTS = 16
_THREAD_CHUNKS_IN_FLIGHT = 4
# Threads for tokenizers that release the GIL only up to this many workers: about a third of the
# per-document work (JSON, the id lists tiktoken builds, arrays, writing) holds the GIL, which
# caps threads at about 1.5x for 2 and 2x for 4 workers, while processes scale on, at a start-up
# cost (0.3-0.5 CPU s each) that large corpora repay. On the 2-core machine two threads beat
# two processes in CPU and wall time (docs/benchmarks/preprocess_gpt2bpe_cpu_2026-12-02b.md).
_MAX_THREAD_WORKERS = 2

# One tokenizer per worker process, set by the pool initializer.
_worker_tokenizer: Tokenizer | None = None


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Input files in a fixed order: files as given, directories walked sorted, globs sorted."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            for root, dirs, names in os.walk(item):
                dirs.sort()
                files += [os.path.join(root, name) for name in sorted(names)]
        elif os.path.isfile(item):
            files.append(item)
        elif _GLOB_CHARACTERS & set(item):
            matches = sorted(
                path for path in glob.glob(item, recursive=True) if os.path.isfile(path)
            )
            if not matches:
                raise FileNotFoundError(f"--input glob {item!r} matches no files")
            files += matches
        else:
            raise FileNotFoundError(f"--input {item!r} is not a file, directory or glob")
    if not files:
        raise ValueError(f"--input {' '.join(inputs)!r} holds no files: the corpus is empty")
    return files


def _first_undecodable_line(path: str) -> str:
    """'PATH:LINE: byte 0x.. at column C' for the first line of path that is not UTF-8."""
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                byte = line[error.start]
                return f"{path}:{line_number}: byte 0x{byte:02x} at column {error.start + 1}"
    return path  # unreachable for a file that failed to decode; keeps the message useful


def iter_tasks(files: Sequence[str]) -> Iterator[tuple[str, str, int, str]]:
    """(kind, path, line number, payload): one task per JSONL line or per text file."""
    for path in files:
        if path.endswith(JSON_SUFFIXES):
            try:
                with open(path, encoding="utf-8") as handle:
                    for line_number, line in enumerate(handle, start=1):
                        if line.strip():
                            yield "json", path, line_number, line
            except UnicodeDecodeError:
                # The decoder reads ahead in blocks, so its error gives a block offset, not a
                # line; find the line again in binary.
                raise ValueError(
                    f"{_first_undecodable_line(path)} is not UTF-8; re-encode --input as UTF-8 "
                    "(for example `iconv -f latin1 -t utf-8`)"
                ) from None
        else:
            # Workers read text files themselves: only the path crosses the process boundary.
            yield "text", path, 0, ""


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _document_texts(task: tuple[str, str, int, str], json_keys: Sequence[str]) -> list[str]:
    kind, path, line_number, payload = task
    if kind == "text":
        if list(json_keys) != [TEXT_KEY]:
            raise ValueError(
                f"{path} is a plain text file, which only provides --json-keys {TEXT_KEY}"
            )
        try:
            return [Path(path).read_text(encoding="utf-8")]
        except UnicodeDecodeError as error:
            raise ValueError(f"--input file {path} is not UTF-8 text ({error})") from error
    try:
        record = json.loads(payload)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number} is not valid JSON ({error})") from error
    texts = []
    for key in json_keys:
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(
                f"{path}:{line_number} has no string field {key!r}; set --json-keys to the "
                "field that holds the text"
            )
        texts.append(record[key])
    return texts


def encode_task(
    task: tuple[str, str, int, str],
    *,
    tokenizer: Tokenizer,
    json_keys: Sequence[str],
    append_eod: bool,
) -> tuple[list[np.ndarray], int]:
    """Token arrays (one per key) of one document and its size in UTF-8 bytes."""
    texts = _document_texts(task, json_keys)
    arrays, num_bytes = [], 0
    for text in texts:
        token_ids = tokenizer.tokenize(text)
        if append_eod:
            token_ids.append(tokenizer.eod)
        arrays.append(np.asarray(token_ids, dtype=np.int64))
        num_bytes += len(text.encode("utf-8"))
    return arrays, num_bytes


def _encode_in_worker(task_and_options: tuple) -> tuple[list[np.ndarray], int]:
    task, json_keys, append_eod = task_and_options
    return encode_task(
        task, tokenizer=_worker_tokenizer, json_keys=json_keys, append_eod=append_eod
    )


class Progress:
    """Documents/s and MB/s: a tqdm bar when tqdm is installed, else a line every N documents."""

    def __init__(self, *, log_interval: int, enabled: bool) -> None:
        self.log_interval = max(1, log_interval)
        self.enabled = enabled
        self.started = time.monotonic()
        self.documents = 0
        self.num_bytes = 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(unit="doc", file=sys.stderr, mininterval=1.0)
            except ImportError:
                self._bar = None

    def rates(self) -> tuple[float, float]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return self.documents / elapsed, self.num_bytes / elapsed / 1e6

    def update(self, num_bytes: int) -> None:
        self.documents += 1
        self.num_bytes += num_bytes
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if self.documents % self.log_interval == 0:
                self._bar.set_postfix_str(f"{self.rates()[1]:.2f} MB/s", refresh=False)
        elif self.documents % self.log_interval == 0:
            docs_per_s, mb_per_s = self.rates()
            print(
                f"processed {self.documents} documents ({docs_per_s:.1f} docs/s, "
                f"{mb_per_s:.2f} MB/s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> str:
        if self._bar is not None:
            self._bar.close()
        docs_per_s, mb_per_s = self.rates()
        elapsed = time.monotonic() - self.started
        summary = (
            f"done: {self.documents} documents, {self.num_bytes} bytes in {elapsed:.1f} s "
            f"({docs_per_s:.1f} docs/s, {mb_per_s:.2f} MB/s)"
        )
        if self.enabled:
            print(summary, file=sys.stderr, flush=True)
        return summary


def _encoded_in_threads(
    tasks: Iterator[tuple[str, str, int, str]],
    *,
    tokenizer: Tokenizer,
    json_keys: Sequence[str],
    append_eod: bool,
    workers: int,
) -> Iterator[tuple[list[np.ndarray], int]]:
    """Encoded documents in input order, tokenized by `workers` threads of this process.

    For tokenizers whose tokenize() releases the GIL (tiktoken's Rust encoder): the threads
    encode in parallel, and there are no worker processes to start, no tokenizer to pickle
    into each, and no token arrays to send back. Documents go in chunks (fewer hand-offs), and
    at most a few chunks per thread are in flight, so memory stays bounded on any corpus.
    """

    def encode_chunk(chunk: list[tuple[str, str, int, str]]) -> list[tuple[list[np.ndarray], int]]:
        return [
            encode_task(task, tokenizer=tokenizer, json_keys=json_keys, append_eod=append_eod)
            for task in chunk
        ]

    in_flight: collections.deque[concurrent.futures.Future] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        while True:
            chunk = list(itertools.islice(tasks, _THREAD_CHUNK_DOCUMENTS))
            if chunk:
                in_flight.append(pool.submit(encode_chunk, chunk))
            # Results are taken in submission order, so the output does not depend on threads.
            while in_flight and (not chunk or len(in_flight) >= _THREAD_CHUNKS_IN_FLIGHT * workers):
                yield from in_flight.popleft().result()
            if not chunk:
                return


def _encoded_documents(
    files: Sequence[str],
    *,
    tokenizer: Tokenizer,
    json_keys: Sequence[str],
    append_eod: bool,
    workers: int,
) -> Iterator[tuple[list[np.ndarray], int]]:
    """Encoded documents in input order, tokenized in `workers` processes."""
    tasks = iter_tasks(files)
    if workers == 1:
        for task in tasks:
            yield encode_task(task, tokenizer=tokenizer, json_keys=json_keys, append_eod=append_eod)
        return
    if workers <= _MAX_THREAD_WORKERS and getattr(tokenizer, "tokenize_releases_gil", False):
        yield from _encoded_in_threads(
            tasks, tokenizer=tokenizer, json_keys=json_keys, append_eod=append_eod, workers=workers
        )
        return
    # spawn, not fork: callers (tests, training scripts) may have threads running, and fork
    # with threads can deadlock; the tokenizer is pickled once per worker.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        options = ((task, tuple(json_keys), append_eod) for task in tasks)
        # imap keeps input order, so the output does not depend on the number of workers.
        yield from pool.imap(_encode_in_worker, options, chunksize=16)


def preprocess(
    inputs: Sequence[str],
    *,
    output_prefix: str,
    tokenizer: Tokenizer,
    json_keys: Sequence[str] = (TEXT_KEY,),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    show_progress: bool = True,
) -> dict[str, str]:
    """Write OUTPUT_PREFIX_KEY_document.bin/.idx per JSON key; return {key: path prefix}.

    Tokens are stored in the smallest dtype holding the tokenizer's ids (token_dtype_for_vocab).
    Files are written under temporary names and renamed when complete; an empty corpus raises.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not json_keys:
        raise ValueError("--json-keys needs at least one key")
    files = expand_inputs(inputs)
    # GPT-2 BPE picks (and checks) its encoder here, once, before workers receive copies.
    encoder_name = getattr(tokenizer, "encoder_name", None)
    if show_progress and encoder_name is not None:
        print(f"{type(tokenizer).__name__} encoder: {encoder_name}", file=sys.stderr, flush=True)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {key: IndexedDatasetBuilder(prefix, dtype=dtype) for key, prefix in prefixes.items()}
    progress = Progress(log_interval=log_interval, enabled=show_progress)
    try:
        documents = _encoded_documents(
            files, tokenizer=tokenizer, json_keys=json_keys, append_eod=append_eod, workers=workers
        )
        for arrays, num_bytes in documents:
            for key, array in zip(json_keys, arrays):
                builders[key].add_document(array)
            progress.update(num_bytes)
        for key, builder in builders.items():
            if builder.num_tokens == 0:
                raise ValueError(
                    f"the corpus is empty: {progress.documents} documents from --input "
                    f"{' '.join(inputs)!r} give 0 tokens for key {key!r}; nothing to write"
                )
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        progress.close()
    return prefixes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSONL/text files, directories or globs to tokenize",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=[TEXT_KEY],
        help="JSON fields to tokenize; one output per key",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes OUTPUT_PREFIX_KEY_document.bin/.idx"
    )
    parser.add_argument(
        "--tokenizer-type",
        default="ByteTokenizer",
        choices=TOKENIZER_TYPES,
        help="tokenizer name (default ByteTokenizer: needs no files)",
    )
    parser.add_argument(
        "--tokenizer-model",
        help="HuggingFace tokenizer.json (or its directory), TikTokenizer JSON vocabulary or "
        "SentencePiece .model",
    )
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json for GPT2BPETokenizer")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt for GPT2BPETokenizer")
    parser.add_argument(
        "--vocab-size", type=int, help="vocabulary size for NullTokenizer or TikTokenizer"
    )
    parser.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer regex")
    parser.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved for special tokens",
    )
    parser.add_argument("--tiktoken-special-tokens", nargs="+", help="TikTokenizer special tokens")
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document id after every document",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer processes; 2 workers are 2 threads of one process for tokenizers that "
        "release the GIL (GPT2BPETokenizer on tiktoken, TikTokenizer)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="documents between progress lines when tqdm is not installed",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tokenizer = build_tokenizer(
            tokenizer_type=args.tokenizer_type,
            vocab_size=args.vocab_size,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tiktoken_pattern=args.tiktoken_pattern,
            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
            tiktoken_special_tokens=args.tiktoken_special_tokens,
        )
        prefixes = preprocess(
            args.input,
            output_prefix=args.output_prefix,
            tokenizer=tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
        )
    except (ValueError, OSError, ImportError) as error:
        parser.exit(2, f"preprocess_data.py: error: {error}\n")
    for prefix in prefixes.values():
        print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
