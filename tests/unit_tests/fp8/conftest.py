"""Fixtures that change the FP8 package's debug state through its own functions and restore it."""

import pytest

from megatron.core.fp8.cuda import gemm as cuda_gemm
from megatron.core.fp8.debug import DEBUG, set_debug_config


@pytest.fixture
def tiles():
    """`tiles(key, config)` overrides kernel `key`'s launch configuration (DEBUG.tiles) for the
    test; the previous overrides come back afterwards."""
    previous = set_debug_config(tiles=dict(DEBUG.tiles))

    def override(key, config):
        set_debug_config(tiles={**DEBUG.tiles, key: config})

    yield override
    set_debug_config(**previous)


@pytest.fixture
def blockwise_probe():
    """`blockwise_probe(path, refused="")` sets cuda.gemm's blockwise probe state for the test
    (it starts untried); the previous state comes back afterwards."""
    previous = cuda_gemm.set_blockwise_path()
    yield cuda_gemm.set_blockwise_path
    cuda_gemm.set_blockwise_path(**previous)
