"""Small random corpora for dataset tests."""

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

VOCAB_SIZE = 1000
EOD = VOCAB_SIZE - 1


def write_random_corpus(prefix, *, num_documents, seed, max_length=30):
    """Documents of random length (1..max_length) ending in EOD; returns them as lists."""
    rng = np.random.RandomState(seed)
    documents = []
    builder = IndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for _ in range(num_documents):
        length = int(rng.randint(1, max_length + 1))
        tokens = rng.randint(0, EOD, size=length - 1).tolist() + [EOD]
        builder.add_document(tokens)
        documents.append(tokens)
    builder.finalize()
    return documents
