"""An independent .bin/.idx reader written from the format description (struct + numpy only).

It shares no code with megatron.core.datasets, so that the writer is checked against the
specification rather than against its own reader.
"""

import struct

import numpy as np

FORMAT_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def read_megatron_pair(prefix):
    """Return (dtype code, document_indices, list of token arrays), asserting the layout."""
    with open(prefix + ".idx", "rb") as handle:
        raw = handle.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    num_sequences, num_document_indices = struct.unpack_from("<QQ", raw, 18)
    assert version == 1
    offset = 34
    lengths = np.frombuffer(raw, dtype="<i4", count=num_sequences, offset=offset)
    offset += 4 * num_sequences
    pointers = np.frombuffer(raw, dtype="<i8", count=num_sequences, offset=offset)
    offset += 8 * num_sequences
    document_indices = np.frombuffer(raw, dtype="<i8", count=num_document_indices, offset=offset)
    offset += 8 * num_document_indices
    assert offset == len(raw), "trailing bytes after document_indices"
    dtype = np.dtype(FORMAT_DTYPES[code]).newbyteorder("<")
    with open(prefix + ".bin", "rb") as handle:
        data = handle.read()
    assert len(data) == int(lengths.sum()) * dtype.itemsize
    documents = [
        np.frombuffer(data, dtype=dtype, count=int(length), offset=int(pointer))
        for length, pointer in zip(lengths, pointers)
    ]
    return code, document_indices, documents
