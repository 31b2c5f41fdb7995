"""Assemble full fp32 parameters from a torch_dist checkpoint in one process (HF export)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def load_full_model_params(
    checkpoint_dir: str | os.PathLike, *, model_key: str = "model"
) -> dict[str, torch.Tensor]:
    """{param name: full fp32 tensor} from the Megatron-FSDP model state under `model_key`.

    Needs no process group: DCP reads every rank's piece into one full tensor per parameter.
    """
    reader = dcp.FileSystemReader(str(Path(checkpoint_dir)))
    metadata = reader.read_metadata()
    params_prefix = f"{model_key}.params."
    shapes_prefix = f"{model_key}.param_shapes."
    template: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and key.startswith(
            (params_prefix, shapes_prefix)
        ):
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not template:
        raise ValueError(
            f"load_full_model_params: no '{params_prefix}*' tensors in {checkpoint_dir}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: loading on one rank"
        dcp.load(template, checkpoint_id=str(checkpoint_dir), no_dist=True)
    result = {}
    for key, value in template.items():
        if key.startswith(params_prefix):
            name = key[len(params_prefix) :]
            shape = template[shapes_prefix + name].tolist()
            result[name] = value.view(shape)
    return result
