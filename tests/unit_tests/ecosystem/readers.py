"""Read scalar series back from what MetricsLogger wrote, with each backend's own formats.

Both readers return {metric name: [(step, value), ...]} in the order the points were logged,
so a test can compare whole series, not just the last value.

TensorBoard: tensorboard's EventAccumulator (its own event-file reader).
W&B offline: the run's `.wandb` transaction log, the file `wandb sync` uploads. wandb >= 0.19
no longer ships a Python reader for it (the Go `wandb-core` reads it), so we decode its
LevelDB-log framing here and parse each record with the package's own protobuf schema
(`wandb.proto.wandb_internal_pb2.Record`). The framing, as written by wandb-core:
  file header: 4s ident ":W&B", u16 magic 0xBEE1, u8 version 0 (7 bytes, little endian)
  then 32 KiB blocks of chunks: u32 crc32(type byte + data), u16 length, u8 type, data
  type 1 = full record, 2/3/4 = first/middle/last piece of a record split across blocks;
  a block tail shorter than a chunk header (7 bytes) is zero padding.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib

_WANDB_IDENT = b":W&B"
_WANDB_MAGIC = 0xBEE1
_BLOCK_BYTES = 32768
_CHUNK_HEADER = struct.Struct("<IHB")
_FILE_HEADER = struct.Struct("<4sHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalar series in the TensorBoard event files under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    # size_guidance 0 = keep every point (the default reservoir-samples 10,000 per tag).
    accumulator = EventAccumulator(log_dir, size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()[SCALARS]
    }


def _wandb_record_payloads(data: bytes) -> list[bytes]:
    """Split a .wandb file's bytes into serialized Record messages, checking every crc."""
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if ident != _WANDB_IDENT or magic != _WANDB_MAGIC or version != 0:
        raise ValueError(f"not a W&B transaction log (header {ident!r} {magic:#x} v{version})")
    payloads: list[bytes] = []
    pending = b""
    offset = _FILE_HEADER.size
    while offset + _CHUNK_HEADER.size <= len(data):
        block_left = _BLOCK_BYTES - offset % _BLOCK_BYTES
        if block_left < _CHUNK_HEADER.size:
            offset += block_left
            continue
        checksum, length, chunk_type = _CHUNK_HEADER.unpack_from(data, offset)
        start = offset + _CHUNK_HEADER.size
        chunk = data[start : start + length]
        if checksum == 0 and length == 0 and chunk_type == 0:
            break  # zero-filled tail of the last block: end of the log
        if zlib.crc32(chunk, zlib.crc32(bytes([chunk_type]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"W&B transaction log chunk at byte {offset} fails its checksum")
        offset = start + length
        if chunk_type == _FULL:
            payloads.append(chunk)
        elif chunk_type == _FIRST:
            pending = chunk
        elif chunk_type == _MIDDLE:
            pending += chunk
        elif chunk_type == _LAST:
            payloads.append(pending + chunk)
            pending = b""
        else:
            raise ValueError(f"unknown chunk type {chunk_type} at byte {offset}")
    return payloads


def _history_points(record: object) -> tuple[int, dict[str, float]]:
    """(step, {name: value}) of one history Record, dropping W&B's own `_`-prefixed keys."""
    step = record.history.step.num
    values: dict[str, float] = {}
    for item in record.history.item:
        key = item.key or "/".join(item.nested_key)
        if key == "_step":
            step = int(json.loads(item.value_json))
        elif not key.startswith("_"):
            values[key] = float(json.loads(item.value_json))
    return step, values


def read_wandb_offline_scalars(save_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of the one offline run under `save_dir` (the `dir` given to wandb.init;
    the run lives in <save_dir>/wandb/offline-run-*/run-*.wandb)."""
    from wandb.proto import wandb_internal_pb2

    pattern = os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb")
    run_files = sorted(glob.glob(pattern))
    if len(run_files) != 1:
        raise ValueError(f"expected exactly one offline W&B run matching {pattern}: {run_files}")
    with open(run_files[0], "rb") as run_file:
        data = run_file.read()
    series: dict[str, list[tuple[int, float]]] = {}
    for payload in _wandb_record_payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        step, values = _history_points(record)
        for name, value in values.items():
            series.setdefault(name, []).append((step, value))
    return series
