"""Assemble full fp32 parameters from a torch_dist checkpoint in one process (HF export)."""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.dist_checkpointing.serialization import checkpoint_path, load_error


def load_full_model_params(
    checkpoint_dir: str | os.PathLike, *, model_key: str = "model"
) -> dict[str, torch.Tensor]:
    """{param name: full fp32 tensor} from the Megatron-FSDP model state under `model_key`.

    Needs no process group: DCP reads every rank's piece into one full tensor per parameter.
    Raises CheckpointError, naming the path, for a missing, truncated or foreign checkpoint.
    """
    path = checkpoint_path(checkpoint_dir)
    metadata = SafeFileSystemReader(str(path)).read_metadata()  # checked by checkpoint_path
    params_prefix = f"{model_key}.params."
    shapes_prefix = f"{model_key}.param_shapes."
    template: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and key.startswith(
            (params_prefix, shapes_prefix)
        ):
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not any(key.startswith(params_prefix) for key in template):
        raise CheckpointError(
            f"{path}: no '{params_prefix}*' tensors, so this is not a Megatron-FSDP model "
            "checkpoint; pass the iter_XXXXXXX/sharded directory that --save wrote."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: loading on one rank"
        try:
            dcp.load(template, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
        except (Exception, CheckpointException) as error:  # CheckpointException: BaseException
            message = str(load_error(path, error)).replace("Load another", "Export another")
            raise CheckpointError(message) from None
    result = {}
    for key, value in template.items():
        if not key.startswith(params_prefix):
            continue
        name = key[len(params_prefix) :]
        shape = template.get(shapes_prefix + name)
        if shape is None or math.prod(shape.tolist()) != value.numel():
            raise CheckpointError(
                f"{path}: {name} has no recorded shape of {value.numel()} elements; the "
                "checkpoint is corrupt. Export another iteration."
            )
        result[name] = value.view(shape.tolist())
    return result
