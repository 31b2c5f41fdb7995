"""GPT data: .bin/.idx indexed datasets, GPT samples, blending, mock data."""

from megatron.core.datasets.blended_dataset import BlendedDataset, build_blending_indices
from megatron.core.datasets.builder import (
    build_gpt_datasets,
    parse_data_path,
    parse_split,
    split_document_ranges,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, build_item
from megatron.core.datasets.indexed_dataset import (
    CorruptIndexError,
    IndexedDataset,
    IndexedDatasetBuilder,
    token_dtype_for_vocab,
)
from megatron.core.datasets.mock_dataset import MockGPTDataset

__all__ = [
    "BlendedDataset",
    "CorruptIndexError",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockGPTDataset",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_item",
    "parse_data_path",
    "parse_split",
    "split_document_ranges",
    "token_dtype_for_vocab",
]
