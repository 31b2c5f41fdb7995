"""The files of a checkpoint and how they are read: directory and tracker names, metadata.json
and its checks, tensor files read with `weights_only`, the JSON forms of the model config and the
RNG state, and the agreement of all ranks on a failure. Saving is in save.py, loading
into a run in load.py, the checks against this run's flags in checks.py;
__init__.py describes the layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.checkpoint_files import TMP_SUFFIX, CheckpointError, resolve_published_dir
from megatron.core.dist_checkpointing import load_full_model_params
from megatron.core.fp8 import delayed_scaling_state_dict
from megatron.core.fp8.config import Fp8Config
from megatron.core.tensor_parallel import tensor_parallel_shards
from megatron.core.transformer.moe.moe_layer import local_expert_rows
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpoint.sharded import SHARDED_FORMATS
from megatron.training.initialize import DistributedEnv
from megatron.training.model_setup import ModelAndOptimizer

FORMAT_TAG = "megatron-fp8"
FORMAT_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# metadata.json entries that loading reads, with their JSON types.
REQUIRED_METADATA = {
    "ckpt_format": str,
    "iteration": int,
    "consumed_train_samples": int,
    "skipped_iterations": int,
    "nan_iterations": int,
    "scheduler": dict,
    "model_config": dict,
    "args": dict,
}


def saved_run_flags(metadata: dict) -> dict:
    """The run's flags as resolved: metadata "args" holds them as given and "resolved_args" the
    values derived from them; a checkpoint saved before the split holds resolved "args" only."""
    return {**metadata["args"], **metadata.get("resolved_args", {})}


def checkpoint_param_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape as checkpoints record it: a routed expert's full
    [num_experts, ...] shape (global expert index), whatever this rank's expert-parallel share,
    and a tensor-parallel shard's full (TP = 1) shape."""
    rows = local_expert_rows(module)
    experts = module.config.num_moe_experts if rows else None
    tp_owners = tensor_parallel_shards(module)
    shapes = {}
    for name, param in module.named_parameters():
        if name in rows:
            shapes[name] = (experts, *param.shape[1:])
        elif name in tp_owners:
            shapes[name] = tuple(tp_owners[name].full_shape(name.rsplit(".", 1)[-1]))
        else:
            shapes[name] = tuple(param.shape)
    return shapes


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def config_to_json(config: TransformerConfig) -> dict:
    data = dataclasses.asdict(config)
    data["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return data


def config_from_json(data: dict) -> TransformerConfig:
    data = dict(data)
    data["params_dtype"] = getattr(torch, data["params_dtype"])
    if data.get("fp8") is not None:
        data["fp8"] = Fp8Config(**data["fp8"])
    return TransformerConfig(**data)


def rng_state_to_plain(state: dict) -> dict:
    """numpy's state holds an ndarray, which weights_only loading rejects: store it as a tensor."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    plain = dict(state)
    plain["numpy"] = [
        name,
        torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        pos,
        has_gauss,
        cached,
    ]
    plain["python"] = [state["python"][0], list(state["python"][1]), state["python"][2]]
    return plain


def rng_state_from_plain(plain: dict) -> dict:
    state = dict(plain)
    name, keys, pos, has_gauss, cached = plain["numpy"]
    state["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    version, internal, gauss = plain["python"]
    state["python"] = (version, tuple(internal), gauss)
    return state


def first_failing_rank(env: DistributedEnv, failure: BaseException | None) -> int:
    """Every rank's verdict at once: the lowest failing rank, or -1 when all succeeded. It
    stands in for the barrier between the save's phases, so no rank waits on one that gave up."""
    if env.all_ranks_group is None:
        return env.rank if failure is not None else -1
    # gloo and NCCL both reduce a float MIN; ranks that succeeded send the world size.
    code = torch.tensor(
        [float(env.rank if failure is not None else env.world_size)], device=env.device
    )
    dist.all_reduce(code, op=dist.ReduceOp.MIN, group=env.all_ranks_group)
    failed = int(code.item())
    return failed if failed < env.world_size else -1


def delayed_scaling_state(run: ModelAndOptimizer) -> dict:
    if run.config.fp8 is None or not run.config.fp8.spec.delayed:
        return {}
    return delayed_scaling_state_dict(run.module)


_ITERATION_DIR = re.compile(r"iter_(\d{7})(\.old)?")


BUFFERS_FILENAME = "model_buffers.pt"
"""Persistent module buffers that are not parameters (the routers' aux-loss-free expert bias):
identical on every rank, written by rank 0 in every --ckpt-format."""


def model_buffers(run: ModelAndOptimizer) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name (those its state_dict holds)."""
    persistent = run.module.state_dict(keep_vars=True).keys()
    return {name: buf for name, buf in run.module.named_buffers() if name in persistent}


def read_buffers_file(directory: str) -> dict[str, torch.Tensor]:
    """The saved buffers, {} for a checkpoint written before they were saved."""
    path = os.path.join(directory, BUFFERS_FILENAME)
    if not os.path.isfile(path):
        return {}
    named = load_tensor_file(path)
    if not isinstance(named, dict) or not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise CheckpointError(f"{path}: not a {{buffer name: tensor}} dict; the file is corrupt.")
    return named


def complete_iteration_dirs(root: str) -> list[str]:
    """The names of root's published iteration directories (iter_XXXXXXX, or the complete
    .old copy of an interrupted re-save), oldest first; unfinished .tmp saves are left out."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITERATION_DIR.fullmatch(name)
        if match and os.path.isfile(os.path.join(root, name, "metadata.json")):
            found.append((int(match.group(1)), name))
    return [name for _, name in sorted(found)]


def check_load_path(load: str, ckpt_step: int | None = None) -> None:
    """--load must name a --save directory, or one that does not exist yet (a first start of
    `--save X --load X` trains from scratch). Cheap: pretrain calls it before building anything.

    A --save directory whose tracker is gone but which holds iterations is refused rather than
    trained from scratch (the work would be thrown away silently): --ckpt-step picks one."""
    if os.path.exists(load) and not os.path.isdir(load):
        raise CheckpointError(
            f"--load {load} is a file, not a directory; point --load at the directory that "
            f"--save wrote (it holds {TRACKER_FILENAME} and iter_XXXXXXX/)."
        )
    is_iteration_dir = os.path.isfile(os.path.join(load, "metadata.json"))
    if is_iteration_dir and not os.path.isfile(os.path.join(load, TRACKER_FILENAME)):
        raise CheckpointError(
            f"--load {load} is one iteration's directory; pass its parent, the --save directory "
            f"(its {TRACKER_FILENAME} picks the iteration)."
        )
    if ckpt_step is None and not os.path.isfile(os.path.join(load, TRACKER_FILENAME)):
        published = complete_iteration_dirs(load)
        if published:
            newest = int(_ITERATION_DIR.fullmatch(published[-1]).group(1))
            raise CheckpointError(
                f"--load {load} holds {', '.join(published)} but no {TRACKER_FILENAME}, so "
                f"which iteration to resume is unknown; pass --ckpt-step N (e.g. --ckpt-step "
                f"{newest}, the newest) or write N into {os.path.join(load, TRACKER_FILENAME)}."
            )


def read_tracker(root: str) -> int | None:
    """The newest complete iteration under root, or None when root holds no checkpoint."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    fix = "fix or delete the file (it names the newest complete iter_XXXXXXX directory)"
    with open(tracker, "rb") as handle:
        raw = handle.read(64)  # an iteration number is a few digits; more is not a tracker
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: binary data, not an iteration number; {fix}.") from None
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker}: expected an iteration number, found {text[:40]!r}; {fix}."
        )
    return int(text)


def resolve_iteration_dir(root: str, iteration: int) -> str:
    """iter_XXXXXXX of `iteration`, or its complete `.old` copy when a re-save was killed
    between publish_dir's renames (the new copy never took its place)."""
    final = iteration_dir(root, iteration)
    directory = resolve_published_dir(final)
    if directory is None:
        unfinished = os.path.isdir(f"{final}{TMP_SUFFIX}")
        raise CheckpointError(
            f"{os.path.join(root, TRACKER_FILENAME)} names iteration {iteration}, but {final} "
            f"does not exist{' (its .tmp copy is an unfinished save)' if unfinished else ''}; "
            "write the iteration of a complete iter_XXXXXXX directory into the tracker."
        )
    return directory


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{directory}: no metadata.json, so this is not a complete megatron-fp8 checkpoint; "
            "point --load at a directory written by --save."
        )
    try:
        with open(path, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{path}: not valid JSON ({type(error).__name__}: {error}); the file is corrupt. "
            "Load another iteration."
        ) from None
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{path}: holds a JSON {type(metadata).__name__}, not an object; the file is "
            "corrupt. Load another iteration."
        )
    if metadata.get("format") != FORMAT_TAG:
        raise CheckpointError(
            f"{path}: format {metadata.get('format')!r} is not {FORMAT_TAG!r}; this checkpoint "
            "was written by another program."
        )
    if metadata.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {metadata.get('version')} is not {FORMAT_VERSION}."
        )
    bad = [
        f"{key} (missing)" if key not in metadata else f"{key} (not a JSON {kind.__name__})"
        for key, kind in REQUIRED_METADATA.items()
        if not isinstance(metadata.get(key), kind)
    ]
    if bad:
        raise CheckpointError(
            f"{path}: bad entries {', '.join(bad)}; the file is corrupt or was edited. "
            "Load another iteration."
        )
    return metadata


def load_tensor_file(path: str) -> dict:
    """torch.load with weights_only=True; any failure becomes a CheckpointError naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(
            f"{path}: cannot be read ({type(error).__name__}); the file is truncated, corrupt "
            "or holds objects other than tensors. Load another iteration."
        ) from None


def read_model_file(directory: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, "model.pt")
    named = load_tensor_file(path)
    if not isinstance(named, dict) or not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise CheckpointError(
            f"{path}: not a {{param name: tensor}} dict; the file is corrupt. Load another "
            "iteration."
        )
    return named


def load_state_for_export(
    checkpoint_dir: str, iteration: int | None = None
) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """Full fp32 params by model parameter name (and the persistent buffers, e.g. the routers'
    expert bias), and the model config, from any checkpoint.

    `checkpoint_dir` is a --save root (the tracker picks the iteration unless given) or one
    iter_XXXXXXX directory.
    """
    if os.path.isfile(os.path.join(checkpoint_dir, "metadata.json")):
        directory = checkpoint_dir
    else:
        if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise CheckpointError(
                f"{checkpoint_dir}: a file; pass a --save directory or an iter_XXXXXXX directory."
            )
        iteration = iteration if iteration is not None else read_tracker(checkpoint_dir)
        if iteration is None:
            raise CheckpointError(
                f"{checkpoint_dir}: no {TRACKER_FILENAME}; pass a --save directory or an "
                "iter_XXXXXXX directory."
            )
        directory = resolve_iteration_dir(checkpoint_dir, iteration)
    metadata = read_metadata(directory)
    try:
        config = config_from_json(metadata["model_config"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"{directory}/metadata.json: 'model_config' is not a model config "
            f"({type(error).__name__}: {error}); the file is corrupt or was edited."
        ) from None
    if metadata["ckpt_format"] in SHARDED_FORMATS:
        params = load_full_model_params(os.path.join(directory, "sharded"))
    else:
        params = read_model_file(directory)
    return {**params, **read_buffers_file(directory)}, config
