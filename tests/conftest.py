"""Shared pytest configuration: GPU tests skip on CPU with a reason; global RNGs seeded per test."""

import os

import numpy as np
import pytest
import torch

# Two CPU cores: keep intra-op threads low so that multi-rank gloo tests do not oversubscribe.
torch.set_num_threads(int(os.environ.get("MEGATRON_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; its CPU-emulated twin runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_gpt2_bpe_table_cache(monkeypatch):
    """GPT2BPETokenizer's on-disk cache of checked tiktoken tables stays off in tests (no files
    under ~/.cache, and every test runs the vocabulary check); the cache's own tests point
    MEGATRON_GPT2_BPE_CACHE at a temporary directory."""
    monkeypatch.setenv("MEGATRON_GPT2_BPE_CACHE", "off")


@pytest.fixture(autouse=True)
def _seed_global_rngs():
    """Tests that draw from torch's or numpy's global RNG get the same numbers whatever ran
    before them (a file run alone, a subset, or the whole suite)."""
    torch.manual_seed(1234)
    np.random.seed(1234)
    yield
