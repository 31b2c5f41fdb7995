"""Our GPTDataset serves megatron-core 0.16.1's samples in megatron-core's order.

The fixture holds the first 1,000 samples of megatron-core's GPTDataset (train, valid, test) and
of a weighted 2-way blend, built by make_mcore_fixture.py from corpora that this test rewrites
with our writer (the files must be byte-identical first).
"""

import hashlib
import os

import numpy as np
import pytest

from megatron.core.datasets import BlendedDataset, GPTDatasetConfig, build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.unit_tests.data import make_mcore_fixture as fixture_spec

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", fixture_spec.FIXTURE_NAME)


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE) as arrays:
        return {name: arrays[name] for name in arrays.files}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mcore_corpora")
    prefixes = {}
    for name, seed, num_documents, max_length in fixture_spec.CORPORA:
        prefix = str(directory / name)
        builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
        for document in fixture_spec.corpus_documents(seed, num_documents, max_length):
            builder.add_document(document)
        builder.finalize()
        prefixes[name] = prefix
    return prefixes


def _build(data_path, cache_dir):
    config = GPTDatasetConfig(
        seq_length=fixture_spec.SEQ_LENGTH,
        seed=fixture_spec.SEED,
        data_path=data_path,
        split=fixture_spec.SPLIT,
        vocab_size=fixture_spec.VOCAB_SIZE,
        eod_id=fixture_spec.EOD,
        path_to_cache=str(cache_dir),
    )
    return build_gpt_datasets(config, num_samples=fixture_spec.NUM_SAMPLES)


def _first_tokens(dataset, count):
    rows = []
    for index in range(count):
        item = dataset[index]
        rows.append(np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]]))
    return np.stack(rows)


def test_corpus_files_are_byte_identical_to_megatron_cores(corpora, reference):
    for name, prefix in corpora.items():
        for suffix in ("bin", "idx"):
            with open(f"{prefix}.{suffix}", "rb") as handle:
                digest = hashlib.md5(handle.read()).hexdigest()
            assert digest == str(reference[f"{name}_{suffix}_md5"]), (name, suffix)


@pytest.mark.parametrize("split_name", ["train", "valid", "test"])
def test_first_1000_samples_equal_megatron_cores(corpora, reference, tmp_path, split_name):
    datasets = dict(zip(("train", "valid", "test"), _build([corpora["corpus_a"]], tmp_path)))
    dataset = datasets[split_name]
    expected = reference[f"{split_name}_tokens"]
    assert expected.shape == (fixture_spec.FIRST_SAMPLES, fixture_spec.SEQ_LENGTH + 1)
    assert len(dataset) == int(reference[f"{split_name}_length"])
    actual = _first_tokens(dataset, fixture_spec.FIRST_SAMPLES)
    mismatched = np.flatnonzero((actual != expected).any(axis=1))
    assert mismatched.size == 0, f"{mismatched.size} samples differ, first {mismatched[:5]}"


def test_first_1000_blended_samples_equal_megatron_cores(corpora, reference, tmp_path):
    weight_a, weight_b = fixture_spec.BLEND_WEIGHTS
    data_path = [str(weight_a), corpora["corpus_a"], str(weight_b), corpora["corpus_b"]]
    train, _, _ = _build(data_path, tmp_path)
    assert isinstance(train, BlendedDataset)
    assert len(train) == int(reference["blend_train_length"])
    assert [len(part) for part in train.datasets] == reference["blend_part_lengths"].tolist()
    first = fixture_spec.FIRST_SAMPLES
    assert np.array_equal(train.dataset_index[:first], reference["blend_train_dataset_index"])
    actual = _first_tokens(train, first)
    mismatched = np.flatnonzero((actual != reference["blend_train_tokens"]).any(axis=1))
    assert mismatched.size == 0, f"{mismatched.size} samples differ, first {mismatched[:5]}"
