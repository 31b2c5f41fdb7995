"""Blending tracks the weights; mock data is deterministic from the seed."""

import numpy as np
import pytest
import torch

from megatron.core.datasets import (
    BlendedDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    build_blending_indices,
    build_gpt_datasets,
)
from megatron.core.datasets.blended_dataset import blend_sizes, normalize_weights
from tests.unit_tests.data.corpus_utils import EOD, VOCAB_SIZE, write_random_corpus


def test_blend_three_to_one_over_10000_samples(tmp_path):
    write_random_corpus(tmp_path / "a", num_documents=30, seed=1)
    write_random_corpus(tmp_path / "b", num_documents=30, seed=2)
    config = GPTDatasetConfig(
        seq_length=8,
        seed=5,
        data_path=["3", str(tmp_path / "a"), "1", str(tmp_path / "b")],
        split="1",
        vocab_size=VOCAB_SIZE,
        eod_id=EOD,
    )
    train, valid, test = build_gpt_datasets(config, num_samples=(10_000, 0, 0))
    assert valid is None and test is None
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    from_a = train.dataset_index == 0
    assert abs(from_a.mean() - 0.75) <= 0.02
    # Stronger than the 2% bound: after every prefix of n draws, a has served 0.75 n +- 1.
    served_a = np.cumsum(from_a)
    assert np.max(np.abs(served_a - 0.75 * np.arange(1, 10_001))) <= 1.0
    # Each source's samples are drawn in order 0, 1, 2, ... without repeats.
    for dataset_id in (0, 1):
        drawn = train.dataset_sample_index[train.dataset_index == dataset_id]
        assert drawn.tolist() == list(range(drawn.size))
    for index in (0, 1, 2, 3, 4, 9_999):
        source = train.datasets[train.dataset_index[index]]
        expected = source[int(train.dataset_sample_index[index])]["tokens"]
        assert torch.equal(train[index]["tokens"], expected)


def test_blending_indices_are_megatron_cores_greedy_choice():
    # Draw n goes to argmax_d(w_d * max(n, 1) - served_d), ties to the lower id: with 3:1,
    # draw 4 is a tie (0.75 * 4 - 3 == 0.25 * 4 - 1) and goes to dataset 0.
    ids, samples = build_blending_indices([0.75, 0.25], size=1000)
    assert ids[:10].tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert samples[:10].tolist() == [0, 0, 1, 2, 3, 1, 4, 5, 6, 2]
    short_ids, short_samples = build_blending_indices([0.75, 0.25], size=100)
    assert np.array_equal(short_ids, ids[:100]) and np.array_equal(short_samples, samples[:100])
    ids, _ = build_blending_indices([0.5, 0.3, 0.2], size=1000)
    assert np.bincount(ids).tolist() == [500, 300, 200]
    with pytest.raises(ValueError, match="normalized"):
        build_blending_indices([3.0, 1.0], size=10)


def test_blend_sizes_add_megatron_cores_surplus():
    # Each dataset is asked for ceil(ceil(size * w) * 1.005); the blend draws sum(ceil(size * w)).
    assert blend_sizes([0.6, 0.4], size=1500) == ([905, 603], 1500)
    assert blend_sizes([1 / 3, 2 / 3], size=100) == ([35, 68], 101)
    assert normalize_weights([3, 1]) == [0.75, 0.25]


def _mock_config(**overrides):
    values = dict(seq_length=32, seed=7, mock=True, vocab_size=50, eod_id=49)
    values.update(overrides)
    return GPTDatasetConfig(**values)


def test_mock_dataset_deterministic_and_counting():
    train, valid, test = build_gpt_datasets(_mock_config(), num_samples=(20, 4, 0))
    assert (len(train), len(valid), test) == (20, 4, None)
    again = MockGPTDataset(config=_mock_config(), num_samples=500, split_name="train")
    other_seed = MockGPTDataset(config=_mock_config(seed=8), num_samples=20, split_name="train")
    for index in range(20):
        assert torch.equal(train[index]["tokens"], again[index]["tokens"])
    assert not torch.equal(train[0]["tokens"], other_seed[0]["tokens"])
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])
    tokens = torch.cat([train[index]["tokens"] for index in range(20)])
    assert tokens.shape == (20 * 32,) and int(tokens.min()) >= 0 and int(tokens.max()) <= 49
    # Inside a document each token is the previous one plus one, counting over ids 0..48.
    for index in range(20):
        item = train[index]
        sample = torch.cat([item["tokens"], item["labels"][-1:]]).tolist()
        assert item["labels"].tolist() == sample[1:]
        for previous, current in zip(sample, sample[1:]):
            if EOD not in (previous, current) and previous != 49 and current != 49:
                assert current == (previous + 1) % 49
    assert (tokens == 49).sum() > 0  # documents end in eod


def test_mock_respects_eod_mask_and_position_reset():
    dataset = MockGPTDataset(
        config=_mock_config(eod_mask_loss=True, reset_position_ids=True),
        num_samples=5,
        split_name="train",
    )
    for index in range(5):
        item = dataset[index]
        is_eod = item["tokens"] == 49
        assert torch.equal(item["loss_mask"] == 0.0, is_eod)
        after_eod = torch.nonzero(is_eod[:-1]).flatten() + 1
        assert item["position_ids"][after_eod].tolist() == [0] * after_eod.numel()


def test_blend_indices_are_cached_and_reread(tmp_path, monkeypatch):
    write_random_corpus(tmp_path / "a", num_documents=30, seed=1)
    write_random_corpus(tmp_path / "b", num_documents=30, seed=2)
    config = GPTDatasetConfig(
        seq_length=8,
        seed=5,
        data_path=["0.6", str(tmp_path / "a"), "0.4", str(tmp_path / "b")],
        split="1",
        vocab_size=VOCAB_SIZE,
        eod_id=EOD,
        path_to_cache=str(tmp_path / "cache"),
    )
    first, _, _ = build_gpt_datasets(config, num_samples=(500, 0, 0))
    cached = sorted(path.name for path in (tmp_path / "cache").glob("*-BlendedDataset-*.npy"))
    assert [name.split("-", 1)[1] for name in cached] == [
        "BlendedDataset-dataset_index.npy",
        "BlendedDataset-dataset_sample_index.npy",
    ]
    import megatron.core.datasets.blended_dataset as blended_module

    def fail(*args, **kwargs):
        raise AssertionError("the blend indices were rebuilt instead of read from the cache")

    monkeypatch.setattr(blended_module, "build_blending_indices", fail)
    again, _, _ = build_gpt_datasets(config, num_samples=(500, 0, 0))
    assert np.array_equal(again.dataset_index, first.dataset_index)
    assert np.array_equal(again.dataset_sample_index, first.dataset_sample_index)
    assert len(again) == 500 and np.bincount(again.dataset_index).tolist() == [300, 200]


@pytest.mark.parametrize(
    "weights", [[0.6, 0.4], [1 / 3, 2 / 3], [0.999, 0.001], [0.5, 0.5], [0.123456789, 0.876543211]]
)
def test_two_way_checked_guess_equals_the_greedy_loop(weights, monkeypatch):
    import megatron.core.datasets.blending_indices as blending

    weights = normalize_weights(weights)
    # several chunks, one partial
    dataset_index, sample_index = blending.build_blending_indices(
        weights, size=50_000, chunk_draws=7_000
    )
    loop = blending._greedy_loop(weights, [0, 0], start=0, stop=50_000)
    assert np.array_equal(dataset_index, loop)
    for dataset_id in (0, 1):
        drawn = sample_index[dataset_index == dataset_id]
        assert drawn.tolist() == list(range(drawn.size))
    # A guess that is always dataset 0 still gives the rule's choices (corrected, or by the loop).
    monkeypatch.setattr(blending, "_guess", lambda w, served, count: np.zeros(count, np.int64))
    assert np.array_equal(blending.build_blending_indices(weights, size=3_000)[0], loop[:3_000])
