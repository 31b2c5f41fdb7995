"""GPTDataset indices: deterministic, cached, and equal to a brute-force reconstruction."""

import os
import pickle

import numpy as np
import pytest
import torch

from megatron.core.datasets import (
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    build_gpt_datasets,
    build_item,
    split_document_ranges,
)
from tests.unit_tests.data.corpus_utils import EOD, VOCAB_SIZE, write_random_corpus
from tests.unit_tests.dist_utils import run_distributed

SEQ_LENGTH = 16


def _config(prefix, **overrides):
    values = dict(
        seq_length=SEQ_LENGTH,
        seed=1234,
        data_path=[str(prefix)],
        vocab_size=VOCAB_SIZE,
        eod_id=EOD,
        split="8,1,1",
    )
    values.update(overrides)
    return GPTDatasetConfig(**values)


def _dataset(prefix, cache_dir, *, num_samples, document_range=(0, 40), **overrides):
    return GPTDataset(
        indexed_dataset=IndexedDataset(str(prefix)),
        split_name="train",
        document_range=document_range,
        num_samples=num_samples,
        config=_config(prefix, **overrides),
        cache_dir=str(cache_dir),
    )


@pytest.fixture
def corpus(tmp_path):
    prefix = tmp_path / "corpus"
    documents = write_random_corpus(prefix, num_documents=40, seed=0)
    return prefix, documents


def test_indices_deterministic_cached_and_seed_dependent(corpus, tmp_path):
    prefix, _ = corpus
    first = _dataset(prefix, tmp_path / "cache_a", num_samples=100)
    second = _dataset(prefix, tmp_path / "cache_b", num_samples=100)
    other_seed = _dataset(prefix, tmp_path / "cache_a", num_samples=100, seed=99)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name
        assert not np.array_equal(getattr(first, name), getattr(other_seed, name)), name
    assert (first.indices_source, second.indices_source) == ("built", "built")

    cached_files = sorted((tmp_path / "cache_a").glob(f"{first.cache_prefix.split('/')[-1]}*"))
    assert len(cached_files) == 3
    mtimes = [os.stat(path).st_mtime_ns for path in cached_files]
    reread = _dataset(prefix, tmp_path / "cache_a", num_samples=100)
    assert reread.indices_source == "cache"
    assert [os.stat(path).st_mtime_ns for path in cached_files] == mtimes
    assert np.array_equal(reread.shuffle_index, first.shuffle_index)
    assert not list((tmp_path / "cache_a").glob("*.tmp-*"))


def test_samples_equal_brute_force_concatenation(corpus, tmp_path):
    prefix, documents = corpus
    dataset = _dataset(prefix, tmp_path / "cache", num_samples=150)
    tokens_per_epoch = sum(len(document) for document in documents)
    # Enough epochs E for 150 samples of 16 + 1 tokens; every whole sample of them is served.
    num_epochs = -(-(150 * SEQ_LENGTH + 1) // tokens_per_epoch)
    assert dataset.num_epochs == num_epochs >= 2
    assert len(dataset) == (num_epochs * tokens_per_epoch - 1) // SEQ_LENGTH >= 150
    # Each document appears once per epoch; the epochs are shuffled together (megatron-core).
    assert np.bincount(dataset.document_index).tolist() == [num_epochs] * 40
    stream = np.concatenate([documents[doc] for doc in dataset.document_index])
    for sample in range(len(dataset)):
        expected = stream[sample * SEQ_LENGTH : sample * SEQ_LENGTH + SEQ_LENGTH + 1]
        assert dataset.sample_tokens(sample).tolist() == expected.tolist(), sample
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))
    item = dataset[7]
    unshuffled = stream[dataset.shuffle_index[7] * SEQ_LENGTH :][: SEQ_LENGTH + 1]
    assert item["tokens"].tolist() == unshuffled[:-1].tolist()
    assert item["labels"].tolist() == unshuffled[1:].tolist()


def test_one_epoch_indices_follow_megatron_cores_random_state_order(corpus, tmp_path):
    # One RandomState(seed): first the int32 document ids are shuffled in place, then the
    # sample ids 0..n-1 (megatron-core's _build_document_index and _build_shuffle_index).
    prefix, _ = corpus
    dataset = _dataset(prefix, tmp_path / "cache", num_samples=10)
    assert dataset.num_epochs == 1
    rng = np.random.RandomState(1234)
    documents = np.arange(40, dtype=np.int32)
    rng.shuffle(documents)
    samples = np.arange(len(dataset), dtype=np.uint32)
    rng.shuffle(samples)
    assert dataset.document_index.tolist() == documents.tolist()
    assert dataset.shuffle_index.tolist() == samples.tolist()


def test_sequence_longer_than_an_epoch_spans_several_epochs(tmp_path):
    documents = write_random_corpus(tmp_path / "short", num_documents=3, seed=5, max_length=10)
    tokens_per_epoch = sum(len(document) for document in documents)
    seq_length = 3 * tokens_per_epoch + 1
    dataset = GPTDataset(
        indexed_dataset=IndexedDataset(str(tmp_path / "short")),
        split_name="train",
        document_range=(0, 3),
        num_samples=4,
        config=_config(tmp_path / "short", seq_length=seq_length),
        cache_dir=str(tmp_path / "cache"),
    )
    stream = np.concatenate([documents[doc] for doc in dataset.document_index])
    assert len(dataset) >= 4
    for sample in range(len(dataset)):
        expected = stream[sample * seq_length : (sample + 1) * seq_length + 1]
        assert dataset.sample_tokens(sample).tolist() == expected.tolist()


def test_order_depends_on_epochs_requested_as_in_megatron_core(corpus, tmp_path):
    # Requests within one epoch give the same dataset; a request that needs more epochs
    # reshuffles everything, as in Megatron-LM (a longer run sees other first samples).
    prefix, _ = corpus
    small = _dataset(prefix, tmp_path / "cache", num_samples=10)
    same_epoch = _dataset(prefix, tmp_path / "cache", num_samples=20)
    large = _dataset(prefix, tmp_path / "cache", num_samples=400)
    assert (small.num_epochs, same_epoch.num_epochs) == (1, 1) and large.num_epochs > 3
    assert len(small) == len(same_epoch) and len(large) > 3 * len(small)
    for index in range(len(small)):
        assert torch.equal(small[index]["tokens"], same_epoch[index]["tokens"])
    assert not torch.equal(small[0]["tokens"], large[0]["tokens"])


def test_pickled_datasets_reopen_files_instead_of_copying(corpus, tmp_path):
    prefix, documents = corpus
    indexed = IndexedDataset(str(prefix))
    payload = pickle.dumps(indexed)
    assert len(payload) < 500  # the path only, not the memory-mapped tokens
    reopened = pickle.loads(payload)
    assert [reopened[index].tolist() for index in range(40)] == documents


def test_build_item_masks_and_positions():
    sample = np.array([5, EOD, 3, 4, EOD, EOD, 1])
    plain = build_item(sample, eod_id=EOD, reset_position_ids=False, eod_mask_loss=False)
    assert plain["tokens"].dtype == torch.int64 and plain["loss_mask"].dtype == torch.float32
    assert plain["tokens"].tolist() == [5, EOD, 3, 4, EOD, EOD]
    assert plain["labels"].tolist() == [EOD, 3, 4, EOD, EOD, 1]
    assert plain["loss_mask"].tolist() == [1.0] * 6
    assert plain["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]
    masked = build_item(sample, eod_id=EOD, reset_position_ids=True, eod_mask_loss=True)
    assert masked["loss_mask"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert masked["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]


def test_split_ranges_and_builder(corpus, tmp_path):
    prefix, _ = corpus
    assert split_document_ranges(40, [0.8, 0.1, 0.1]) == [(0, 32), (32, 36), (36, 40)]
    assert split_document_ranges(1000, [969 / 1000, 30 / 1000, 1 / 1000]) == [
        (0, 969),
        (969, 999),
        (999, 1000),
    ]
    # 3 documents, 969,30,1: valid and test round to zero documents.
    assert split_document_ranges(3, [0.969, 0.03, 0.001]) == [(0, 3), (3, 3), (3, 3)]
    train, valid, test = build_gpt_datasets(_config(prefix), num_samples=(50, 8, 0))
    assert test is None
    assert len(train) >= 50 and len(valid) >= 8
    assert set(train.document_index.tolist()) == set(range(32))
    assert set(valid.document_index.tolist()) == set(range(32, 36))
    # Default cache directory: index-cache next to the corpus.
    assert os.path.dirname(train.cache_prefix) == str(prefix.parent / "index-cache")


def _build_on_rank(rank, world_size, prefix, cache_dir):
    config = _config(prefix, path_to_cache=cache_dir)
    train, _, _ = build_gpt_datasets(config, num_samples=(40, 0, 0))
    return train.indices_source, [train[index]["tokens"].tolist() for index in range(5)]


def test_rank0_builds_others_read_cache(corpus, tmp_path):
    prefix, _ = corpus
    results = run_distributed(_build_on_rank, 2, str(prefix), str(tmp_path / "shared_cache"))
    assert [source for source, _ in results] == ["built", "cache"]
    assert results[0][1] == results[1][1]
