"""Time tools/preprocess_data.py with GPT2BPETokenizer: this checkout against another one.

    python3 benchmarks/preprocess_gpt2bpe.py --baseline-repo /tmp/base --workers 1 2

Builds a JSONL corpus of about --corpus-mb MB from the Python standard library's sources (one
file a document: code, prose in docstrings, some non-ASCII), trains a GPT-2 sized byte-level BPE
vocabulary on it with the `tokenizers` package (vocab.json + merges.txt: GPT-2's own files are
not downloaded), then runs each checkout's tools/preprocess_data.py on it with --workers W and
prints wall and CPU times and whether the .bin/.idx files are byte-identical. Needs
`tokenizers`.

This checkout's cache of checked tiktoken tables (MEGATRON_GPT2_BPE_CACHE) is a fresh directory
under --output-dir: the first run checks the new vocabulary and fills it ("cold", reported on
its own), the timed runs read it, as every run after the first on a machine does. --repeats R
runs each checkout R times per --workers, interleaved, and reports the medians and the spread.
Results: docs/benchmarks/preprocess_gpt2bpe_cpu_2026-12-02.md and
docs/benchmarks/preprocess_gpt2bpe_cpu_2026-12-02b.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, *, source_dir: str, target_bytes: int) -> tuple[int, int]:
    """JSONL of the sorted .py files under source_dir until target_bytes; (documents, bytes)."""
    sources = []
    for root, dirs, names in os.walk(source_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        sources += [os.path.join(root, name) for name in sorted(names) if name.endswith(".py")]
    documents = total = 0
    with open(path, "w", encoding="utf-8") as handle:
        for source in sources:
            if total >= target_bytes:
                break
            try:
                with open(source, encoding="utf-8") as source_handle:
                    text = source_handle.read()
            except (UnicodeDecodeError, OSError):
                continue
            handle.write(json.dumps({"text": text}) + "\n")
            documents += 1
            total += len(text.encode("utf-8"))
    return documents, total


def train_vocab(corpus: str, output_dir: str, *, vocab_size: int) -> tuple[str, str]:
    import tokenizers

    def texts():
        with open(corpus, encoding="utf-8") as handle:
            for line in handle:
                yield json.loads(line)["text"]

    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        texts(), vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    trainer.save_model(output_dir)
    return os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt")


def run_preprocess(repo: str, *, corpus: str, prefix: str, vocab: str, merges: str, workers: int):
    """(wall s, CPU s of the run and its workers) of one tools/preprocess_data.py run in
    `repo`; md5 of its .bin and .idx. CPU time is the steadier number on a shared machine."""
    command = [
        sys.executable,
        os.path.join(repo, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--append-eod",
        "--workers",
        str(workers),
    ]
    environment = dict(os.environ, PYTHONPATH=repo)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(command, check=True, env=environment, capture_output=True, cwd=repo)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    digests = []
    for suffix in ("bin", "idx"):
        with open(f"{prefix}_text_document.{suffix}", "rb") as handle:
            digests.append(hashlib.md5(handle.read()).hexdigest())
    return (wall, cpu), tuple(digests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=os.path.join(REPO, "runs", "bench_preprocess"))
    parser.add_argument("--baseline-repo", help="another checkout to compare with (the 'before')")
    parser.add_argument("--corpus-mb", type=float, default=5.0)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--source-dir", default=sysconfig.get_paths()["stdlib"])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per checkout")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, "corpus.jsonl")
    documents, num_bytes = write_corpus(
        corpus, source_dir=args.source_dir, target_bytes=int(args.corpus_mb * 1e6)
    )
    print(f"corpus: {documents} documents, {num_bytes / 1e6:.2f} MB from {args.source_dir}")
    started = time.monotonic()
    vocab, merges = train_vocab(corpus, args.output_dir, vocab_size=args.vocab_size)
    print(f"vocab: {args.vocab_size} tokens trained in {time.monotonic() - started:.1f} s")
    cache = os.path.join(args.output_dir, "gpt2_bpe_cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["MEGATRON_GPT2_BPE_CACHE"] = cache
    checkouts = [("this", REPO)]
    if args.baseline_repo:
        checkouts.append(("baseline", args.baseline_repo))

    def run(name: str, repo: str, workers: int, label: str):
        prefix = os.path.join(args.output_dir, f"{name}_w{workers}")
        (wall, cpu), digests = run_preprocess(
            repo, corpus=corpus, prefix=prefix, vocab=vocab, merges=merges, workers=workers
        )
        print(
            f"{label:22s} --workers {workers}: wall {wall:6.2f} s ({num_bytes / 1e6 / wall:5.2f}"
            f" MB/s), CPU {cpu:6.2f} s, md5 bin {digests[0]} idx {digests[1]}",
            flush=True,
        )
        return (wall, cpu), digests

    _, cold_digests = run("this", REPO, args.workers[0], "this (cold cache)")
    results: dict[tuple[str, int], list] = {}
    for repeat in range(args.repeats):
        for workers in args.workers:
            for name, repo in checkouts:
                label = f"{name} #{repeat + 1}"
                results.setdefault((name, workers), []).append(run(name, repo, workers, label))
    if not args.baseline_repo:
        return 0
    for workers in args.workers:
        this_runs, base_runs = results[("this", workers)], results[("baseline", workers)]
        digests = [cold_digests] + [run_digests for _, run_digests in this_runs + base_runs]
        identical = all(run_digests == digests[-1] for run_digests in digests)
        for index, what in ((0, "wall"), (1, "CPU")):
            this_s = [seconds[index] for seconds, _ in this_runs]
            base_s = [seconds[index] for seconds, _ in base_runs]
            ratios = [base / this for base, this in zip(base_s, this_s)]
            print(
                f"--workers {workers} {what:4s}: median {statistics.median(base_s):6.2f} s -> "
                f"{statistics.median(this_s):5.2f} s, "
                f"{statistics.median(base_s) / statistics.median(this_s):.1f}x "
                f"(per repeat {min(ratios):.1f}x to {max(ratios):.1f}x)"
            )
        print(f"--workers {workers}: byte-identical in every run: {identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
