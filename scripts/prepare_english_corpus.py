"""Build the English corpus: documentation prose from Debian packages, BPE-tokenized (issue 41).

    PREFIX=$(python3 scripts/prepare_english_corpus.py --output-dir DIR | tail -n 1)

Sources (--packages; the reStructuredText that Sphinx keeps in html/_sources):
- `python3-doc` (Debian 12: python3.11-doc), the Python documentation, about 11 MB; licence:
  the Python Software Foundation License Version 2 (code examples also Zero-Clause BSD).
- `linux-doc` (Debian 12: linux-doc-6.1), the Linux kernel's Documentation/, about 24 MB;
  licence: GPL-2.0, with some files under other free documentation licences that their SPDX
  lines name (the media API pages GFDL-1.1-no-invariants-or-later, a few CC-BY-4.0).
- Sphinx sources of eight more (about 22 MB together), each licence as its Debian copyright file
  states for `Files: *`: llvm-15-doc and clang-15-doc (Apache-2.0 WITH LLVM-exception),
  python-pandas-doc, python-astropy-doc, python-sympy-doc, python-skimage-doc (BSD-3-Clause),
  sphinx-doc (BSD-2-Clause), python-cryptography-doc (Apache-2.0 or BSD-3-Clause).
Each package's /usr/share/doc/<package>/copyright has the full terms. A package that is not
installed is fetched with `apt-get download` and unpacked with `dpkg-deb -x` into DIR (no root
needed; the only network is Debian's package archive). --source-dir takes directories of
.txt/.rst files instead.

Steps: the files, in a fixed shuffled order (so the validation split, the last documents,
samples every source), become one document each, reST inline roles reduced to their text
(":func:`len`" -> "len"); a byte-level BPE vocabulary of --vocab-size ids is trained on them
with the `tokenizers` library (an optional extra: pip install tokenizers), its last id the
end-of-document token <|endoftext|>; the documents are tokenized with the project's
preprocessing (tools/preprocess_data.py) into DIR/pydocs_text_document.{bin,idx}.
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
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.tokenizer import HuggingFaceTokenizer  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402

MANIFEST_VERSION = 2
# Debian packages of Sphinx documentation (their html/_sources hold the reST text), and licences.
LICENCES = {
    "python3-doc": "Python Software Foundation License Version 2 (code examples also 0BSD)",
    "linux-doc": "GPL-2.0 (kernel Documentation/; some files GFDL-1.1+ or CC-BY-4.0, per SPDX)",
    "llvm-15-doc": "Apache-2.0 WITH LLVM-exception",
    "clang-15-doc": "Apache-2.0 WITH LLVM-exception",
    "python-pandas-doc": "BSD-3-Clause",
    "python-astropy-doc": "BSD-3-Clause",
    "python-sympy-doc": "BSD-3-Clause",
    "python-skimage-doc": "BSD-3-Clause",
    "sphinx-doc": "BSD-2-Clause",
    "python-cryptography-doc": "Apache-2.0 or BSD-3-Clause",
}
EOD_TOKEN = "<|endoftext|>"
SHUFFLE_SEED = 0
# :role:`text` and :role:`title <target>` -> text / title; a leading ! or ~ is Sphinx markup.
_ROLE = re.compile(r":[a-zA-Z:]+:`[!~]?([^`<]*?)\s*(?:<[^`>]*>)?`")


def _apt(*command: str, cwd: str | None = None) -> str:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True).stdout


def versioned_package(package: str) -> str:
    """The package holding the files: python3-doc -> python3.11-doc, linux-doc -> linux-doc-6.1
    (each depends on its versioned package); a package without such a dependency itself."""
    stem = re.match(r"[a-z]+", package).group(0)
    for name in re.findall(r"Depends: (\S+)", _apt("apt-cache", "depends", package)):
        if name.startswith(stem) and any(c.isdigit() for c in name):
            return name
    return package


def _sources_under(paths: list[str]) -> str | None:
    found = sorted({p[: p.index("/_sources") + 9] for p in paths if "/html/_sources" in p})
    return found[0] if found else None


def find_package_sources(package: str, work_dir: str) -> str:
    """The html/_sources directory of `package`: installed, unpacked before, or fetched now
    with `apt-get download` and unpacked with `dpkg-deb -x` into work_dir/deb."""
    real = versioned_package(package)
    try:
        installed = _sources_under(_apt("dpkg-query", "-L", real).splitlines())
    except subprocess.CalledProcessError:
        installed = None
    if installed and os.path.isdir(installed):
        return installed
    unpack_dir = os.path.join(work_dir, "deb", real)
    debs = sorted(glob.glob(os.path.join(work_dir, f"{real}_*.deb")))
    if not debs:
        print(f"fetching the Debian package {real} into {work_dir}", file=sys.stderr, flush=True)
        os.makedirs(work_dir, exist_ok=True)
        _apt("apt-get", "download", real, cwd=work_dir)
        debs = sorted(glob.glob(os.path.join(work_dir, f"{real}_*.deb")))
        if not debs:
            raise RuntimeError(f"apt-get download {real} wrote no .deb into {work_dir}")
    if not os.path.isdir(unpack_dir):
        shutil.rmtree(unpack_dir + ".tmp", ignore_errors=True)  # a run stopped mid-unpack
        os.makedirs(unpack_dir + ".tmp")
        _apt("dpkg-deb", "-x", debs[-1], unpack_dir + ".tmp")
        os.replace(unpack_dir + ".tmp", unpack_dir)
    found = glob.glob(os.path.join(unpack_dir, "usr/share/doc/*/html/_sources"))
    if not found:
        raise RuntimeError(f"{debs[-1]} holds no usr/share/doc/*/html/_sources")
    return sorted(found)[0]


def source_files(source_dirs: list[str], *, max_bytes: int) -> list[str]:
    """The .txt/.rst files under source_dirs in a fixed shuffled order (so the last documents,
    the validation split, sample every source), the first max_bytes of text."""
    files = []
    for source_dir in source_dirs:
        for root, dirs, names in os.walk(source_dir):
            dirs.sort()
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith((".txt", ".rst"))]
    random.Random(SHUFFLE_SEED).shuffle(files)
    chosen, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        chosen.append(path)
        total += os.path.getsize(path)
    return chosen


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
    *,
    output_dir: str,
    max_bytes: int,
    vocab_size: int,
    packages: Sequence[str] = tuple(LICENCES),
    source_dirs: list[str] | None = None,
) -> tuple[str, dict, bool]:
    """Return (prefix, manifest, reused); reused when a matching corpus was already there.

    source_dirs, when given, replace the packages' documentation sources."""
    os.makedirs(output_dir, exist_ok=True)
    if not source_dirs:
        source_dirs = [find_package_sources(package, output_dir) for package in packages]
        licences = {
            package: LICENCES.get(package, "see its copyright file") for package in packages
        }
    else:
        packages, licences = [], {}
    files = source_files(source_dirs, max_bytes=max_bytes)
    if not files:
        raise RuntimeError(f"no .txt/.rst files under {source_dirs}")
    prefix = os.path.join(output_dir, "pydocs_text_document")
    manifest_path = os.path.join(output_dir, "english_manifest.json")
    manifest = {
        "version": MANIFEST_VERSION,
        "packages": list(packages),
        "licences": licences,
        "source_dirs": source_dirs,
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "eod_token": EOD_TOKEN,
        "files": [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in files],
    }
    if _cached(manifest_path, manifest, prefix):
        with open(manifest_path, encoding="utf-8") as handle:
            return prefix, json.load(handle), True
    print(
        f"preparing the English corpus: {len(files)} files of {source_dirs} into {output_dir}",
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
    parser = argparse.ArgumentParser(description="BPE-tokenize English documentation prose")
    parser.add_argument("--output-dir", default="./data_cache/english")
    parser.add_argument("--max-mb", type=float, default=64.0, help="MB of source text to use")
    parser.add_argument("--vocab-size", type=int, default=16384, help="BPE ids incl. eod")
    parser.add_argument("--packages", nargs="+", default=list(LICENCES), help="Debian packages")
    parser.add_argument("--source-dir", nargs="+", default=None, help="instead of --packages")
    args = parser.parse_args()
    prefix, manifest, reused = prepare(
        output_dir=args.output_dir,
        max_bytes=int(args.max_mb * 1e6),
        vocab_size=args.vocab_size,
        packages=args.packages,
        source_dirs=args.source_dir,
    )
    state = "reused cached" if reused else "wrote"
    print(
        f"{state} {len(manifest['files'])} documents, {manifest['tokens']} tokens, "
        f"vocab {manifest['vocab_size']} (eod {manifest['vocab_size'] - 1}) from "
        + "; ".join(f"{name} ({licence})" for name, licence in manifest["licences"].items()),
        file=sys.stderr,
    )
    print(prefix)


if __name__ == "__main__":
    main()
