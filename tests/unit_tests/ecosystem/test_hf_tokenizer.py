"""The HF export writes the checkpoint's tokenizer so that transformers.AutoTokenizer loads it
and maps text to the ids the model was trained on: byte-level and GPT-2 BPE, end to end for the
byte-level one (train, export, load, round-trip)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.core.tokenizer import build_tokenizer
from tests.unit_tests.data.test_tokenizers import TRAIN_TEXT, _train_hf_byte_bpe
from tests.unit_tests.training.common import run_pretrain
from tools.checkpoint.hf_tokenizer import tokenizer_writer

transformers = pytest.importorskip("transformers", reason="needs `pip install transformers`")
pytest.importorskip("tokenizers", reason="needs `pip install tokenizers`")

TEXTS = ["hello world", "héllo wörld, 日本語 🙂\n\ttabs", *TRAIN_TEXT[:3]]
LLAMA = [
    *("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"),
    *("--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2"),
    *("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"),
    *("--disable-bias-linear", "--untie-embeddings-and-output-weights"),
    *("--mock-data", "--train-iters", "1", "--eval-iters", "0", "--lr", "1e-3"),
]


def _round_trip(directory: Path, ours) -> None:
    loaded = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.tokenize(text), text
        assert loaded.decode(ids) == text
    assert loaded.convert_tokens_to_ids("<|endoftext|>") == ours.eod


def test_byte_tokenizer_export_round_trips(tmp_path: Path) -> None:
    from tools.checkpoint.convert_to_hf import main

    save = tmp_path / "ckpt"
    run_pretrain(LLAMA + ["--tokenizer-type", "ByteTokenizer", "--save", str(save)])
    main(["--load", str(save), "--output", str(tmp_path / "hf")])
    _round_trip(tmp_path / "hf", build_tokenizer(tokenizer_type="ByteTokenizer"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.config.vocab_size >= 257


def test_gpt2_bpe_tokenizer_is_written_from_the_run_files(tmp_path: Path) -> None:
    _train_hf_byte_bpe(tmp_path)
    files = {"vocab_file": str(tmp_path / "vocab.json"), "merge_file": str(tmp_path / "merges.txt")}
    write, said = tokenizer_writer({"tokenizer_type": "GPT2BPETokenizer", **files})
    assert said == "tokenizer: GPT-2 BPE (the run's vocab.json and merges.txt)"
    write(str(tmp_path / "hf"))
    _round_trip(tmp_path / "hf", build_tokenizer(tokenizer_type="GPT2BPETokenizer", **files))


def test_other_tokenizers_are_named_not_written(tmp_path: Path) -> None:
    write, said = tokenizer_writer({"tokenizer_type": "NullTokenizer"})
    assert write is None
    assert said.startswith("no tokenizer written: the ids are --tokenizer-type NullTokenizer's")
    with pytest.raises(FileNotFoundError, match="GPT2BPETokenizer file '/gone/vocab.json'"):
        tokenizer_writer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/gone/vocab.json"})


def test_tokenizer_export_names_the_missing_packages(monkeypatch) -> None:
    """Without tokenizers / transformers, the export stops before writing anything, with the
    pip command (a fresh venv had given 'No module named tokenizers')."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name)
    )
    with pytest.raises(ImportError, match=r"needs tokenizers: run `pip install transformers"):
        tokenizer_writer({"tokenizer_type": "ByteTokenizer"})
    assert tokenizer_writer({"tokenizer_type": "NullTokenizer"})[0] is None  # nothing to write
