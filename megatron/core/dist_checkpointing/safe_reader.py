"""Reading a torch_dist checkpoint without running code from it.

torch.distributed.checkpoint stores its `.metadata` as a pickle and reads it with
`pickle.load`, so a crafted file runs whatever it names; its planner also `torch.load`s any
entry the metadata declares as bytes with `weights_only=False`. SafeFileSystemReader reads the
metadata through an unpickler that admits only the classes DCP's metadata is made of, and
refuses byte entries (this project's checkpoints hold tensors only), so the shard files are
read as tensor data alone. A shard that cannot be read raises ShardReadError naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.futures import Future

# What a .metadata written by torch.distributed.checkpoint consists of (read off checkpoints
# written by torch 2.11 and 2.13): DCP's metadata dataclasses, the file reader's storage info,
# torch.Size, dtypes and the layout lookup, and the checkpoint's relative paths.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}
# megatron-core also stores each rank's save plan in the metadata (`all_local_plans`): DCP's
# plan dataclasses, admitted only when reading such a foreign checkpoint.
_FOREIGN_ALLOWED = {
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
    },
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file that asks to load something a checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream, *, foreign: bool = False) -> None:
        super().__init__(stream)
        self.foreign = foreign

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            self.foreign and name in _FOREIGN_ALLOWED.get(module, ())
        ):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refers to {module}.{name}, which a torch.distributed.checkpoint .metadata never "
            "holds; the file was not written by torch.distributed.checkpoint and was not run"
        )


def load_metadata(stream, *, foreign: bool = False) -> Metadata:
    """A .metadata file's Metadata, read without running code; UnsafeCheckpointError for a
    file that names anything else or declares byte (pickled-object) entries. `foreign`: a
    Megatron-LM checkpoint, read by a caller that never requests its byte entries (pickled
    extra and RNG states), so they are allowed, as are the save plans megatron-core stores."""
    metadata = _MetadataUnpickler(stream, foreign=foreign).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    if foreign:
        return metadata
    pickled = [
        key
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, BytesStorageMetadata)
    ]
    if pickled:
        raise UnsafeCheckpointError(
            f"declares pickled-object entries ({', '.join(sorted(pickled)[:3])}), which "
            "torch.distributed.checkpoint would unpickle with weights_only=False; this "
            "project's checkpoints hold tensors only"
        )
    return metadata


class ShardReadError(Exception):
    """A .distcp shard that cannot be read (missing, truncated, zeroed): `path` names it."""

    def __init__(self, path: str, cause: str) -> None:
        # Both in args: DCP pickles a rank's exception to gather it on the coordinator.
        super().__init__(path, cause)
        self.path = path
        self.cause = cause

    def __str__(self) -> str:
        return f"{self.path}: {self.cause}"


def _describe_read_failure(error: BaseException) -> str:
    """One line for a shard read failure. torch.load's refusal of a zeroed or foreign file
    suggests retrying with weights_only=False, which would run the file's code: never relayed."""
    text = " ".join(str(error).split())
    if "weights_only" in text or isinstance(error, pickle.UnpicklingError):
        return f"{type(error).__name__}: not tensor data"
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: {error.strerror}"
    first_sentence = text.split(". ")[0][:200]  # torch appends paragraphs of guesses
    return f"{type(error).__name__}: {first_sentence}" if text else type(error).__name__


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose metadata goes through load_metadata, and whose shard reads
    name the file that fails."""

    def read_data(self, plan: Any, planner: Any) -> Future:
        """DCP's reader, one shard file at a time, so that a failure carries the file's path."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except AssertionError:  # DCP's size check: the checkpoint does not fit the model
                raise
            except Exception as error:  # torch.load raises many types for a damaged file
                path = os.path.join(str(self.path), relative_path)
                raise ShardReadError(path, _describe_read_failure(error)) from None
        done: Future = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        path = self._get_metadata_path(options.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
