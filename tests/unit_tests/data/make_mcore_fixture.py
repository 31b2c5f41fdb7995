"""Regenerate fixtures/mcore_0_16_1_samples.npz: megatron-core's own GPT samples.

Run with megatron-core 0.16.1's interpreter from a directory that does not hold our
`megatron/` package (it would shadow megatron-core's):

    cd /tmp && REPO/.venv-mcore/bin/python REPO/tests/unit_tests/data/make_mcore_fixture.py

(REPO: the repository root, whose .venv-mcore scripts/setup_mcore_venv.sh creates; an optional
argument names another output directory.)

It writes two small deterministic corpora with megatron-core's IndexedDatasetBuilder, builds
megatron-core's GPTDataset for train/valid/test (one corpus) and a weighted 2-way blend
(BlendedMegatronDatasetBuilder, as `--data-path 0.6 A 0.4 B` does), and stores the first
FIRST_SAMPLES samples' tokens of each, the datasets' lengths and the corpus files' MD5.
test_mcore_sample_order.py rebuilds the same corpora with our writer and compares.

Only numpy is imported at module level: the test imports the corpus description from here.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import numpy as np

VOCAB_SIZE = 1000
EOD = VOCAB_SIZE - 1
SEED = 1234
SEQ_LENGTH = 32
SPLIT = "90,6,4"
# Samples requested per split (train, valid, test), as pretrain_gpt.py derives them from
# --train-iters, --eval-iters and --global-batch-size. Chosen so that the train split spans three
# epochs with a short last one (megatron-core shuffles it separately) and valid/test many.
NUM_SAMPLES = (1500, 1100, 1000)
BLEND_WEIGHTS = (0.6, 0.4)
FIRST_SAMPLES = 1000
# (name, seed, documents, longest document): document lengths vary from 1 token (just eod).
CORPORA = (("corpus_a", 11, 240, 150), ("corpus_b", 22, 120, 90))
FIXTURE_NAME = "mcore_0_16_1_samples.npz"


def corpus_documents(seed: int, num_documents: int, max_length: int) -> list[np.ndarray]:
    """The corpus's documents: random tokens in [0, EOD) each closed by EOD."""
    rng = np.random.RandomState(seed)
    documents = []
    for _ in range(num_documents):
        length = int(rng.randint(1, max_length + 1))
        body = rng.randint(0, EOD, size=length - 1)
        documents.append(np.concatenate([body, [EOD]]).astype(np.uint16))
    return documents


def file_md5(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.md5(handle.read()).hexdigest()


class _FixtureTokenizer:
    """What megatron-core's GPTDataset asks of a tokenizer: vocab size, eod; no pad token."""

    vocab_size = VOCAB_SIZE
    eod = EOD
    # Part of the datasets' cache descriptions (their JSON).
    unique_identifiers = {"class": "_FixtureTokenizer", "vocab_size": VOCAB_SIZE}


def _first_tokens(dataset, count: int) -> np.ndarray:
    """[count, SEQ_LENGTH + 1] tokens: each sample's inputs followed by its last label."""
    rows = []
    for index in range(count):
        item = dataset[index]
        rows.append(np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]]))
    return np.stack(rows).astype(np.uint16)


def _write_corpora(directory: str) -> dict[str, str]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefixes = {}
    for name, seed, num_documents, max_length in CORPORA:
        prefix = os.path.join(directory, name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for document in corpus_documents(seed, num_documents, max_length):
            builder.add_document(np.asarray(document), [len(document)])
        builder.finalize(prefix + ".idx")
        prefixes[name] = prefix
    return prefixes


def _build(prefixes: list[str], weights: list[float] | None, cache: str):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ_LENGTH,
        blend=(prefixes, weights),
        split=SPLIT,
        path_to_cache=cache,
        tokenizer=_FixtureTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(
        GPTDataset, list(NUM_SAMPLES), lambda: True, config
    ).build()


def main(output_dir: str) -> int:
    import torch.distributed as dist

    import megatron.core

    if megatron.core.__version__ != "0.16.1":
        print(f"expected megatron-core 0.16.1, found {megatron.core.__version__}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        # BlendedDataset asks for the rank when it writes its cache: one gloo rank.
        dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
        prefixes = _write_corpora(work)
        single = _build([prefixes["corpus_a"]], None, os.path.join(work, "cache_single"))
        blend = _build(
            [prefixes["corpus_a"], prefixes["corpus_b"]],
            list(BLEND_WEIGHTS),
            os.path.join(work, "cache_blend"),
        )
        arrays = {}
        for split_name, dataset in zip(("train", "valid", "test"), single):
            arrays[f"{split_name}_tokens"] = _first_tokens(dataset, FIRST_SAMPLES)
            arrays[f"{split_name}_length"] = np.array(len(dataset), dtype=np.int64)
        blend_train = blend[0]
        arrays["blend_train_tokens"] = _first_tokens(blend_train, FIRST_SAMPLES)
        arrays["blend_train_length"] = np.array(len(blend_train), dtype=np.int64)
        arrays["blend_train_dataset_index"] = np.asarray(
            blend_train.dataset_index[:FIRST_SAMPLES], dtype=np.int8
        )
        arrays["blend_part_lengths"] = np.array(
            [len(dataset) for dataset in blend_train.datasets], dtype=np.int64
        )
        for name, prefix in prefixes.items():
            for suffix in ("bin", "idx"):
                arrays[f"{name}_{suffix}_md5"] = np.array(file_md5(f"{prefix}.{suffix}"))
        dist.destroy_process_group()
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, FIXTURE_NAME)
    temp_path = path + ".tmp.npz"
    np.savez_compressed(temp_path, **arrays)
    os.replace(temp_path, path)
    for name, array in arrays.items():
        print(f"{name}: {array.shape if array.ndim else array}")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    default_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else default_dir))
