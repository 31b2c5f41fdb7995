"""Build the English corpus: the Python documentation's prose, BPE-tokenized (issue 41).

    PREFIX=$(python3 scripts/prepare_english_corpus.py --output-dir DIR | tail -n 1)

Source: the Debian package `python3-doc` (it depends on `python3.X-doc`; Debian 12 ships
python3.11-doc, about 11 MB of reStructuredText in /usr/share/doc/python3.X/html/_sources).
Licence: the Python Software Foundation License Version 2 (the documentation's code examples
also under the Zero-Clause BSD licence); the package's /usr/share/doc/python3.X-doc/copyright
has the full text. When no such directory is installed, the package is fetched with
`apt-get download` and unpacked with `dpkg-deb -x` into DIR/deb (no root needed; the only
network is Debian's package archive). --source-dir takes any directory of .txt/.rst files.

Steps: each source file (sorted) becomes one document, with reST inline roles reduced to
their text (":func:`len`" -> "len"); a byte-level BPE vocabulary of --vocab-size ids is trained
on the corpus with the `tokenizers` library (an optional extra: pip install tokenizers), the
last id being the end-of-document token <|endoftext|>; the documents are tokenized with the
project's preprocessing (tools/preprocess_data.py) into DIR/pydocs_text_document.{bin,idx}.
DIR/tokenizer.json is the tokenizer. Train on it with either
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR   (needs `tokenizers`)
    --tokenizer-type NullTokenizer --vocab-size V                 (the same ids, no package)
where V is "vocab_size" in DIR/english_manifest.json (NullTokenizer's eod is V - 1, the same
id). A manifest of the inputs makes a second run with unchanged inputs a no-op. The last
stdout line is the prefix to pass as --data-path.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.tokenizer import HuggingFaceTokenizer  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402

MANIFEST_VERSION = 1
PACKAGE = "python3-doc"
LICENCE = "Python Software Foundation License Version 2 (code examples also 0BSD)"
EOD_TOKEN = "<|endoftext|>"
SOURCES_GLOB = "usr/share/doc/python3*/html/_sources"
# :role:`text` and :role:`title <target>` -> text / title; a leading ! or ~ is Sphinx markup.
_ROLE = re.compile(r":[a-zA-Z:]+:`[!~]?([^`<]*?)\s*(?:<[^`>]*>)?`")


def find_source_dir(root: str = "/") -> str | None:
    """The newest installed Python documentation sources directory under root, or None."""
    found = sorted(glob.glob(os.path.join(root, SOURCES_GLOB)))
    return found[-1] if found else None


def fetch_package(work_dir: str) -> str:
    """apt-get download the python3.X-doc package python3-doc depends on; unpack; its sources."""
    if find_source_dir(os.path.join(work_dir, "deb")):
        return find_source_dir(os.path.join(work_dir, "deb"))
    depends = subprocess.run(
        ["apt-cache", "depends", PACKAGE], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"Depends: (python3\.\d+-doc)", depends)
    package = match.group(1) if match else PACKAGE
    os.makedirs(work_dir, exist_ok=True)
    print(f"fetching the Debian package {package} into {work_dir}", file=sys.stderr, flush=True)
    subprocess.run(["apt-get", "download", package], cwd=work_dir, check=True)
    debs = sorted(glob.glob(os.path.join(work_dir, f"{package}_*.deb")))
    if not debs:
        raise RuntimeError(f"apt-get download {package} wrote no .deb into {work_dir}")
    subprocess.run(["dpkg-deb", "-x", debs[-1], os.path.join(work_dir, "deb")], check=True)
    source_dir = find_source_dir(os.path.join(work_dir, "deb"))
    if source_dir is None:
        raise RuntimeError(f"{debs[-1]} holds no {SOURCES_GLOB}")
    return source_dir


def source_files(source_dir: str, *, max_bytes: int) -> list[str]:
    """Sorted .txt/.rst files under source_dir, stopping once max_bytes of text is collected."""
    files, total = [], 0
    for root, dirs, names in os.walk(source_dir):
        dirs.sort()
        for name in sorted(names):
            if not name.endswith((".txt", ".rst")):
                continue
            path = os.path.join(root, name)
            files.append(path)
            total += os.path.getsize(path)
            if total >= max_bytes:
                return files
    return files


def clean(text: str) -> str:
    """The prose of one reST file: inline roles reduced to their text."""
    return _ROLE.sub(r"\1", text)


def write_documents(files: list[str], jsonl_path: str) -> None:
    with open(jsonl_path, "w", encoding="utf-8") as handle:
        for path in files:
            text = clean(Path(path).read_text(encoding="utf-8", errors="replace"))
            handle.write(json.dumps({"text": text}) + "\n")


def train_tokenizer(jsonl_path: str, *, vocab_size: int, output_dir: str) -> str:
    """Train a byte-level BPE of vocab_size ids (the last is EOD_TOKEN); return its JSON path."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as error:
        raise SystemExit(
            "prepare_english_corpus.py trains its BPE vocabulary with the optional `tokenizers` "
            "package: pip install tokenizers (training on the result needs it only with "
            "--tokenizer-type HuggingFaceTokenizer; NullTokenizer reads the same ids)"
        ) from error

    def texts():
        with open(jsonl_path, encoding="utf-8") as handle:
            for line in handle:
                yield json.loads(line)["text"]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    tokenizer.add_special_tokens([EOD_TOKEN])  # the next id: the last one
    path = os.path.join(output_dir, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": EOD_TOKEN}, f)
    return path


def _cached(manifest_path: str, manifest: dict, prefix: str) -> bool:
    if not os.path.isfile(manifest_path):
        return False
    with open(manifest_path, encoding="utf-8") as handle:
        saved = json.load(handle)
    if {k: v for k, v in saved.items() if k in manifest} != manifest:
        return False
    try:
        return len(IndexedDataset(prefix)) == len(manifest["files"])
    except (OSError, ValueError):
        return False


def prepare(
    *, output_dir: str, max_bytes: int, vocab_size: int, source_dir: str | None = None
) -> tuple[str, dict, bool]:
    """Return (prefix, manifest, reused); reused when a matching corpus was already there."""
    os.makedirs(output_dir, exist_ok=True)
    source_dir = source_dir or find_source_dir() or fetch_package(output_dir)
    files = source_files(source_dir, max_bytes=max_bytes)
    if not files:
        raise RuntimeError(f"no .txt/.rst files under {source_dir}")
    prefix = os.path.join(output_dir, "pydocs_text_document")
    manifest_path = os.path.join(output_dir, "english_manifest.json")
    manifest = {
        "version": MANIFEST_VERSION,
        "package": PACKAGE,
        "licence": LICENCE,
        "source_dir": source_dir,
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "eod_token": EOD_TOKEN,
        "files": [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in files],
    }
    if _cached(manifest_path, manifest, prefix):
        with open(manifest_path, encoding="utf-8") as handle:
            return prefix, json.load(handle), True
    print(
        f"preparing the English corpus: {len(files)} files of {source_dir} into {output_dir}",
        file=sys.stderr,
        flush=True,
    )
    jsonl_path = os.path.join(output_dir, "pydocs.jsonl")
    write_documents(files, jsonl_path)
    tokenizer_path = train_tokenizer(jsonl_path, vocab_size=vocab_size, output_dir=output_dir)
    tokenizer = HuggingFaceTokenizer(tokenizer_path)
    if (tokenizer.vocab_size, tokenizer.eod) != (vocab_size, vocab_size - 1):
        raise RuntimeError(
            f"trained tokenizer has vocab {tokenizer.vocab_size} and eod {tokenizer.eod}; "
            f"expected {vocab_size} and {vocab_size - 1} (corpus too small for the vocabulary?)"
        )
    preprocess(
        [jsonl_path],
        output_prefix=os.path.join(output_dir, "pydocs"),
        tokenizer=tokenizer,
        append_eod=True,
        log_interval=1000,
    )
    os.remove(jsonl_path)
    manifest["tokens"] = IndexedDataset(prefix).num_tokens
    temp_path = f"{manifest_path}.tmp-{os.getpid()}"
    with open(temp_path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
    os.replace(temp_path, manifest_path)
    return prefix, manifest, False


def main() -> None:
    parser = argparse.ArgumentParser(description="BPE-tokenize the Python docs' English prose")
    parser.add_argument("--output-dir", default="./data_cache/english")
    parser.add_argument("--max-mb", type=float, default=64.0, help="MB of source text to use")
    parser.add_argument("--vocab-size", type=int, default=16384, help="BPE ids incl. eod")
    parser.add_argument("--source-dir", default=None, help="default: the python3-doc package")
    args = parser.parse_args()
    prefix, manifest, reused = prepare(
        output_dir=args.output_dir,
        max_bytes=int(args.max_mb * 1e6),
        vocab_size=args.vocab_size,
        source_dir=args.source_dir,
    )
    state = "reused cached" if reused else "wrote"
    print(
        f"{state} {len(manifest['files'])} documents, {manifest['tokens']} tokens, "
        f"vocab {manifest['vocab_size']} (eod {manifest['vocab_size'] - 1}) from {PACKAGE} "
        f"({LICENCE})",
        file=sys.stderr,
    )
    print(prefix)


if __name__ == "__main__":
    main()
