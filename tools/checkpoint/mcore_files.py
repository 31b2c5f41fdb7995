"""Reading Megatron-LM's files without megatron-core and without running code from them.

A Megatron-LM `torch_dist` iteration directory holds `metadata.json` (the backend names),
`common.pt` (a torch.save of the non-tensor state: the args Namespace, iteration, ...), and the
torch.distributed.checkpoint files (`.metadata`, `__R_S.distcp`). `common.pt`'s args may name
megatron-core classes (enums such as AttnBackend) that cannot be imported here, where `megatron`
is this project: the unpickler below builds inert stand-ins for every class outside a short
allowlist, so nothing named in the file is imported or called.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron.core.dist_checkpointing.safe_reader import load_metadata
from tools.checkpoint.model_state import ConversionError

TRACKER = "latest_checkpointed_iteration.txt"
BACKENDS = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_ALLOWED = {
    ("argparse", "Namespace"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "object"),
    ("copyreg", "_reconstructor"),
    ("torch", "Size"),
}


class Opaque:
    """Stands for an object of a class outside the allowlist: its name and pickled data."""

    qualname = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} {getattr(self, 'args', ())}>"


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return type(name, (Opaque,), {"qualname": f"{module}.{name}"})


class _RestrictedPickleModule:
    """What torch.load's `pickle_module` needs: an Unpickler class and load."""

    __name__ = "restricted_pickle"
    Unpickler = _RestrictedUnpickler

    @staticmethod
    def load(file, **kwargs: Any) -> Any:
        return _RestrictedUnpickler(file, **kwargs).load()


def read_common(directory: str) -> dict:
    path = os.path.join(directory, "common.pt")
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing; not a complete Megatron-LM torch_dist checkpoint")
    try:
        common = torch.load(
            path, map_location="cpu", pickle_module=_RestrictedPickleModule, weights_only=False
        )
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise ConversionError(f"{path}: cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(common, dict):
        raise ConversionError(f"{path}: holds a {type(common).__name__}, not a dict")
    return common


def saved_args(common: dict) -> dict:
    """Megatron-LM's args as {name: value} ({} when the checkpoint has none)."""
    args = common.get("args")
    if args is None:
        return {}
    return dict(vars(args)) if hasattr(args, "__dict__") else {}


def resolve_iteration_dir(load_dir: str) -> str:
    """The iteration directory: load_dir itself, or the one its tracker names ("release" or N)."""
    if os.path.isfile(os.path.join(load_dir, "metadata.json")):
        return load_dir
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise ConversionError(
            f"{load_dir}: no {TRACKER} and no metadata.json; pass a Megatron-LM --save "
            "directory or one of its iteration directories"
        )
    with open(tracker, encoding="ascii", errors="replace") as handle:
        text = handle.read(64).strip()
    if text == "release":
        directory = os.path.join(load_dir, "release")
    elif text.isdigit():
        directory = os.path.join(load_dir, f"iter_{int(text):07d}")
    else:
        raise ConversionError(f"{tracker}: {text[:40]!r} is neither an iteration nor 'release'")
    if not os.path.isdir(directory):
        raise ConversionError(f"{tracker} names {directory}, which does not exist")
    return directory


def check_backend(directory: str) -> None:
    path = os.path.join(directory, "metadata.json")
    if os.path.isdir(os.path.join(directory, "mp_rank_00")):
        raise ConversionError(
            f"{directory}: a Megatron-LM --ckpt-format torch checkpoint (mp_rank_00/); the mcore "
            "loader reads torch_dist checkpoints: convert it with Megatron-LM first"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            backends = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: cannot be read ({error})") from None
    if not isinstance(backends, dict) or backends.get("sharded_backend") != "torch_dist":
        found = backends.get("sharded_backend") if isinstance(backends, dict) else backends
        raise ConversionError(
            f"{path}: sharded_backend {found!r}; the mcore loader reads Megatron-LM torch_dist "
            "checkpoints"
        )


class _ForeignMetadataReader(dcp.FileSystemReader):
    """FileSystemReader whose .metadata goes through the project's safe unpickler. Megatron-LM
    checkpoints hold pickled objects (extra states, RNG states) as byte entries: they are
    allowed in the metadata, and never requested, so never unpickled."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            return load_metadata(stream, foreign=True)


def tensor_shapes(directory: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor entry in the DCP metadata."""
    try:
        metadata = _ForeignMetadataReader(directory).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        path = os.path.join(directory, ".metadata")
        raise ConversionError(f"{path}: cannot be read ({error})") from None
    return {
        key: (item.size, item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def read_tensors(directory: str, keys: dict[str, tuple[torch.Size, torch.dtype]]) -> dict:
    """The full tensors under `keys` (no process group: DCP assembles every piece)."""
    template = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in keys.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no process group: one process"
            dcp.load(template, storage_reader=_ForeignMetadataReader(directory), no_dist=True)
    except BaseException as error:  # CheckpointException derives from BaseException
        if isinstance(error, KeyboardInterrupt):
            raise
        raise ConversionError(
            f"{directory}: cannot be loaded ({type(error).__name__}); a .distcp file is "
            "truncated, corrupt or missing"
        ) from None
    return template
