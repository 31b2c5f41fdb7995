"""Bad data fails at build time with a message that names the file or flag and the problem."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets import (
    CorruptIndexError,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_gpt_datasets,
)
from megatron.core.tokenizer import ByteTokenizer
from tests.unit_tests.data.corpus_utils import EOD, VOCAB_SIZE, write_random_corpus
from tests.unit_tests.training.common import TINY_GPT

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def prefix(tmp_path):
    path = tmp_path / "corpus"
    write_random_corpus(path, num_documents=10, seed=3)
    return str(path)


def _patch(path, offset, data):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _truncate(path, num_bytes):
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size - num_bytes)


def test_truncated_idx(prefix):
    _truncate(prefix + ".idx", 8)
    with pytest.raises(CorruptIndexError, match=f"{prefix}.idx is .* implies .*truncated"):
        IndexedDataset(prefix)
    _truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 10)
    with pytest.raises(CorruptIndexError, match=r"\.idx is truncated: 10 bytes, shorter than"):
        IndexedDataset(prefix)


@pytest.mark.parametrize(
    ("offset", "data", "message"),
    [
        (0, b"XXIDIDX\x00\x00", "not a Megatron .idx file: bad magic"),
        (9, struct.pack("<Q", 2), "unsupported version 2"),
        (17, struct.pack("<B", 9), "unknown dtype code 9"),
        (34 + 4 * 10 + 8, struct.pack("<q", 12345), "sequence pointers do not match"),
        (34, struct.pack("<i", -1), "a sequence length is negative"),
        (34 + 12 * 10, struct.pack("<q", 1), "document_indices must start at 0 and end at 10"),
    ],
)
def test_corrupt_idx(prefix, offset, data, message):
    _patch(prefix + ".idx", offset, data)
    with pytest.raises(CorruptIndexError, match=message) as error:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(error.value)


def test_truncated_or_mismatched_bin(prefix, tmp_path):
    other = tmp_path / "other"
    write_random_corpus(other, num_documents=10, seed=4)
    os.replace(str(other) + ".bin", prefix + ".bin")  # a .bin from another corpus
    with pytest.raises(CorruptIndexError, match=r"corpus\.bin is \d+ bytes but .*another \.idx"):
        IndexedDataset(prefix)
    write_random_corpus(prefix, num_documents=10, seed=3)
    _truncate(prefix + ".bin", 2)
    with pytest.raises(CorruptIndexError, match="describes .* tokens of uint16"):
        IndexedDataset(prefix)


def _config(data_path, **overrides):
    values = dict(seq_length=8, seed=0, data_path=data_path, vocab_size=VOCAB_SIZE, eod_id=EOD)
    values.update(overrides)
    return GPTDatasetConfig(**values)


def test_vocab_too_large_for_token_dtype(tmp_path):
    path = str(tmp_path / "bytes")
    builder = IndexedDatasetBuilder(path, dtype=np.uint8)
    builder.add_document([1, 2, 255])
    builder.finalize()
    with pytest.raises(ValueError, match=r"vocab size - 1 = 999 does not fit the uint8 tokens of"):
        build_gpt_datasets(_config([path]), num_samples=(4, 0, 0))
    with pytest.raises(ValueError, match=r"token ids in \[1, 300\] do not fit the uint8"):
        IndexedDatasetBuilder(str(tmp_path / "x"), dtype=np.uint8).add_document([1, 300])


def test_missing_prefix_named_before_any_index_is_built(prefix, tmp_path):
    missing = str(tmp_path / "nowhere" / "corpus")
    with pytest.raises(FileNotFoundError, match=f"{missing}.idx does not exist.*preprocess_data"):
        build_gpt_datasets(_config(["1", prefix, "1", missing]), num_samples=(4, 0, 0))
    assert not (tmp_path / "index-cache").exists()


def test_a_directory_or_a_bin_file_as_prefix_gets_the_fix(prefix, tmp_path):
    """The issue's cases: `--data-path some_dir` and a prefix that ends in .bin."""
    with pytest.raises(FileNotFoundError) as raised:
        build_gpt_datasets(_config([str(tmp_path)]), num_samples=(4, 0, 0))
    assert str(raised.value) == (
        f"data file {tmp_path}.idx does not exist; {tmp_path} is a directory; --data-path takes "
        f"the prefix of a .bin/.idx pair inside it (prefixes there: {prefix})"
    )
    with pytest.raises(FileNotFoundError) as raised:
        build_gpt_datasets(_config([prefix + ".bin"]), num_samples=(4, 0, 0))
    assert str(raised.value).endswith(f"--data-path takes the prefix without .bin: pass {prefix}")


@pytest.mark.parametrize(
    ("data_path", "message"),
    [
        (["0", "a", "1", "b"], "weight '0' for 'a' must be a positive number"),
        (["-1", "a", "1", "b"], "weight '-1' for 'a' must be a positive number"),
        (["x", "a", "1", "b"], "weight 'x' \\(before 'a'\\) is not a number"),
        (["1", "a", "b"], "pairs of weight and prefix"),
    ],
)
def test_bad_data_path_weights(data_path, message):
    with pytest.raises(ValueError, match=message):
        build_gpt_datasets(_config(data_path), num_samples=(4, 0, 0))


@pytest.mark.parametrize("split", ["1,2,3,4", "a,b", "0,0,0", "1,-1"])
def test_bad_split(prefix, split):
    with pytest.raises(ValueError, match=f"--split '{split}' must be up to three"):
        build_gpt_datasets(_config([prefix], split=split), num_samples=(4, 0, 0))


def test_bad_config_values():
    with pytest.raises(ValueError, match="eod id 1000 must lie in the vocabulary"):
        _config(["a"], eod_id=1000)
    with pytest.raises(ValueError, match="--seed must be in"):
        _config(["a"], seed=-1)
    with pytest.raises(ValueError, match="--data-path PREFIX .* or --mock-data"):
        _config(None)


def test_train_split_without_documents(tmp_path):
    path = tmp_path / "tiny"
    write_random_corpus(path, num_documents=2, seed=0)
    with pytest.raises(ValueError, match="the train split is empty for --split '0,1,1'"):
        build_gpt_datasets(_config([str(path)], split="0,1,1"), num_samples=(4, 0, 0))


def _write_documents(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix), dtype=dtype)
    for document in documents:
        builder.add_document(document)
    builder.finalize()
    return str(prefix)


def _byte_corpus(prefix):
    """ByteTokenizer documents: bytes of text, then eod 256, the corpus's largest id."""
    tokenizer = ByteTokenizer()
    texts = ["hello world", "ascii only", "zz"]
    return _write_documents(prefix, [tokenizer.tokenize(text) + [tokenizer.eod] for text in texts])


def test_corpus_ids_beyond_vocab_size_fail_before_any_index(tmp_path):
    prefix = _byte_corpus(tmp_path / "bytes")
    cache = tmp_path / "cache"
    config = _config([prefix], vocab_size=100, eod_id=99, path_to_cache=str(cache))  # NullTokenizer
    with pytest.raises(ValueError) as error:
        build_gpt_datasets(config, num_samples=(4, 0, 0))
    assert str(error.value) == (
        f"{prefix}.bin holds token ids up to 256, but the tokenizer's vocabulary has 100 ids "
        "(0..99): the corpus was made with a larger vocabulary. With --tokenizer-type "
        "NullTokenizer pass --vocab-size 257 or more; otherwise pass the tokenizer that made the "
        "corpus, or re-run tools/preprocess_data.py with this one"
    )
    # Only the scanned id range was cached; no sample index was built for the bad corpus.
    (range_file,) = os.listdir(cache)
    assert range_file.endswith("-tokens-id_range.npy")
    assert np.load(cache / range_file).tolist() == [ord(" "), 256]
    # The byte vocabulary (257 ids) fits: the same corpus then builds.
    train, _, _ = build_gpt_datasets(
        _config([prefix], vocab_size=257, eod_id=256, path_to_cache=str(cache)),
        num_samples=(4, 0, 0),
    )
    assert len(train) >= 4


def test_token_id_range_is_cached_and_a_rewritten_corpus_rescans(tmp_path, monkeypatch):
    prefix = _write_documents(tmp_path / "ids", [[5, 17, EOD], [3, EOD]])
    config = _config([prefix], path_to_cache=str(tmp_path / "cache"))
    build_gpt_datasets(config, num_samples=(4, 0, 0))
    scans = []
    real_scan = IndexedDataset.token_id_range
    monkeypatch.setattr(
        IndexedDataset, "token_id_range", lambda self: scans.append(self) or real_scan(self)
    )
    build_gpt_datasets(config, num_samples=(4, 0, 0))
    assert scans == []  # the second build read the cached range
    # Rewritten with an id past the vocabulary (new size and mtime): the range is scanned again.
    _write_documents(tmp_path / "ids", [[5, 17, EOD], [3, 1200, 4, EOD]])
    with pytest.raises(ValueError, match="holds token ids up to 1200, .* --vocab-size 1201 or"):
        build_gpt_datasets(config, num_samples=(4, 0, 0))
    assert len(scans) == 1


def test_token_id_range_is_exact_across_chunks(tmp_path):
    rng = np.random.RandomState(0)
    documents = [rng.randint(10, 500, size=int(rng.randint(1, 20))).tolist() for _ in range(50)]
    documents[31][-1] = 7  # the smallest id, mid-corpus
    documents[-1][-1] = 999  # the largest id, the very last token
    prefix = _write_documents(tmp_path / "chunks", documents)
    # many uneven chunks
    assert IndexedDataset(prefix).token_id_range(chunk_tokens=13) == (7, 999)


def test_negative_token_ids_are_rejected(tmp_path):
    prefix = _write_documents(tmp_path / "signed", [[4, -3, EOD]], dtype=np.int16)
    with pytest.raises(ValueError, match=r"signed\.bin holds token id -3, but token ids are >= 0"):
        build_gpt_datasets(_config([prefix]), num_samples=(4, 0, 0))


def test_cli_vocab_size_below_corpus_ids_fails_before_training(tmp_path):
    prefix = _byte_corpus(tmp_path / "bytes")
    argv = [arg for arg in TINY_GPT if arg != "--mock-data"]
    argv[argv.index("--vocab-size") + 1] = "100"
    argv += ["--data-path", prefix, "--seq-length", "8", "--train-iters", "5"]
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2  # a data flag's error: one line, no traceback
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: rank 0: ") and "Traceback" not in proc.stderr
    assert "holds token ids up to 256, but the tokenizer's vocabulary has 100 ids" in line
    assert "pass --vocab-size 257 or more" in line
    assert "IndexError" not in proc.stderr and "number of parameters" not in proc.stdout
