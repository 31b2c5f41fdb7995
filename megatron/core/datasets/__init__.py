"""GPT data: .bin/.idx indexed datasets, GPT samples, blending, mock data.

Names are imported lazily so that tools (preprocessing workers) that only need the .bin/.idx
writer do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlendedDataset": "blended_dataset",
    "build_blending_indices": "blended_dataset",
    "build_gpt_datasets": "builder",
    "parse_data_path": "builder",
    "parse_split": "builder",
    "split_document_ranges": "builder",
    "GPTDataset": "gpt_dataset",
    "GPTDatasetConfig": "gpt_dataset",
    "build_item": "gpt_dataset",
    "CorruptIndexError": "indexed_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "token_dtype_for_vocab": "indexed_dataset",
    "MockGPTDataset": "mock_dataset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
