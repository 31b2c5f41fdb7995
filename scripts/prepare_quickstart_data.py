"""Build the quickstart corpus: the running Python's standard library, byte-tokenized.

    PREFIX=$(python3 scripts/prepare_quickstart_data.py | tail -n 1)

Tokenizes the standard library's .py files (sorted, test directories and site-packages
skipped, the first --max-mb of text) with the ByteTokenizer into
DIR/stdlib_text_document.{bin,idx}, one document per file followed by eod. A manifest of the
chosen files makes a second run with unchanged inputs a no-op. The last stdout line is the
prefix to pass as --data-path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.tokenizer import ByteTokenizer  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402

MANIFEST_VERSION = 1
# Directories whose files are test data, vendored packages or caches, not library code.
SKIPPED_DIRECTORIES = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib"}


def stdlib_python_files(stdlib_dir: str, *, max_bytes: int) -> list[str]:
    """Sorted UTF-8 .py files under stdlib_dir, stopping once max_bytes of text is collected."""
    files, total = [], 0
    for root, dirs, names in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRECTORIES)
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                size = len(Path(path).read_bytes().decode("utf-8").encode("utf-8"))
            except (UnicodeDecodeError, OSError):
                continue  # a few legacy files use other encodings; the corpus must round-trip
            if size == 0:
                continue
            files.append(path)
            total += size
            if total >= max_bytes:
                return files
    return files


def manifest_for(files: list[str], *, stdlib_dir: str, max_bytes: int) -> dict:
    """What the output depends on: file list, sizes and modification times, and the settings."""
    return {
        "version": MANIFEST_VERSION,
        "stdlib": stdlib_dir,
        "max_bytes": max_bytes,
        "tokenizer": "ByteTokenizer",
        "append_eod": True,
        "files": [[path, os.stat(path).st_size, os.stat(path).st_mtime_ns] for path in files],
    }


def is_cached(prefix: str, manifest_path: str, manifest: dict) -> bool:
    if not os.path.isfile(manifest_path):
        return False
    with open(manifest_path, encoding="utf-8") as handle:
        if json.load(handle) != manifest:
            return False
    try:
        return len(IndexedDataset(prefix)) == len(manifest["files"])
    except (OSError, ValueError):
        return False


def prepare(*, output_dir: str, max_bytes: int, workers: int = 1) -> tuple[str, bool]:
    """Return (prefix, reused): reused is True when a matching corpus was already there."""
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    files = stdlib_python_files(stdlib_dir, max_bytes=max_bytes)
    if not files:
        raise RuntimeError(f"no UTF-8 .py files found under {stdlib_dir}")
    prefix = os.path.join(output_dir, "stdlib_text_document")
    manifest_path = os.path.join(output_dir, "stdlib_manifest.json")
    manifest = manifest_for(files, stdlib_dir=stdlib_dir, max_bytes=max_bytes)
    if is_cached(prefix, manifest_path, manifest):
        return prefix, True
    print(
        f"preparing the quickstart corpus: byte-tokenizing {len(files)} files of {stdlib_dir} "
        f"into {output_dir} (first run only, a few seconds)",
        file=sys.stderr,
        flush=True,
    )
    preprocess(
        files,
        output_prefix=os.path.join(output_dir, "stdlib"),
        tokenizer=ByteTokenizer(),
        append_eod=True,
        workers=workers,
        log_interval=500,
    )
    temp_path = f"{manifest_path}.tmp-{os.getpid()}"
    with open(temp_path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
    os.replace(temp_path, manifest_path)
    return prefix, False


def main() -> None:
    parser = argparse.ArgumentParser(description="Byte-tokenize the Python stdlib for quickstart")
    parser.add_argument("--output-dir", default="./data_cache/quickstart")
    parser.add_argument("--max-mb", type=float, default=6.0, help="MB of source text to use")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    args = parser.parse_args()
    prefix, reused = prepare(
        output_dir=args.output_dir, max_bytes=int(args.max_mb * 1e6), workers=args.workers
    )
    dataset = IndexedDataset(prefix)
    state = "reused cached" if reused else "wrote"
    print(f"{state} {len(dataset)} documents, {dataset.num_tokens} tokens", file=sys.stderr)
    print(prefix)


if __name__ == "__main__":
    main()
