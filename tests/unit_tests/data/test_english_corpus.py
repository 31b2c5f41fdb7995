"""scripts/prepare_english_corpus.py on a small offline slice: reST roles cleaned, a BPE of the
asked size whose last id is eod, .bin/.idx documents ending in eod, a cached second run, and
two training iterations of pretrain_gpt.py on the result with NullTokenizer (issue 41)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[3]
SPEC = importlib.util.spec_from_file_location(
    "prepare_english_corpus", ROOT / "scripts" / "prepare_english_corpus.py"
)
corpus = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(corpus)

PROSE = (
    "The quick brown fox jumps over the lazy dog. A list is a mutable sequence, and a tuple "
    "is an immutable one. Use :func:`len` to count the items of :class:`list <list>` objects, "
    "and :keyword:`!for` statements to walk over them. "
)


def test_clean_reduces_roles_to_their_text():
    text = "Call :func:`len`, see :ref:`the tutorial <tut-intro>` and :meth:`~dict.get`."
    assert corpus.clean(text) == "Call len, see the tutorial and dict.get."


def _sources(tmp_path: Path) -> Path:
    source = tmp_path / "_sources"
    (source / "library").mkdir(parents=True)
    for i in range(6):
        (source / "library" / f"page{i}.rst.txt").write_text(PROSE * (20 + i), encoding="utf-8")
    (source / "notes.bin").write_bytes(b"\x00\x01")  # not .txt/.rst: skipped
    return source


def test_build_small_slice_and_train_two_iterations(tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "english"
    kwargs = dict(output_dir=str(out), max_bytes=10**9, vocab_size=320)
    prefix, manifest, reused = corpus.prepare(source_dirs=[str(_sources(tmp_path))], **kwargs)
    assert not reused and prefix == str(out / "pydocs_text_document")
    assert len(manifest["files"]) == 6 and manifest["vocab_size"] == 320
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 6 and dataset.num_tokens == manifest["tokens"]
    for i in range(6):
        tokens = np.asarray(dataset[i])
        assert tokens[-1] == 319 and (tokens[:-1] < 319).all()  # eod only at the end
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert tokenizer["added_tokens"][-1]["content"] == "<|endoftext|>"
    assert tokenizer["added_tokens"][-1]["id"] == 319
    # A second run with the same inputs reuses the files.
    _, _, reused = corpus.prepare(source_dirs=[str(tmp_path / "_sources")], **kwargs)
    assert reused
    command = [sys.executable, "pretrain_gpt.py", "--data-path", prefix]
    command += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "320", "--split", "50,50,0"]
    command += "--num-layers 1 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 2 \
        --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope \
        --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 --log-interval 1 \
        --eval-interval 2 --eval-iters 1 --seed 5".split()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "iteration        2/       2" in result.stdout + result.stderr
    assert "lm loss value" in result.stdout + result.stderr
