"""Checkpoints: `latest_checkpointed_iteration.txt` plus `iter_0000100/`, written atomically.

Layout of one `iter_XXXXXXX/` directory (`--ckpt-format torch`):
  metadata.json       format tag, iteration, consumed samples, counters, scheduler state, the
                      model config and the flags (plain JSON)
  model.pt            {param name: fp32 tensor}, the main (fp32) values of every parameter
  optimizer.pt        the optimizer state (tensors and numbers only)
  rng/rank_00000.pt   each rank's RNG states (tensors and numbers only)
  fp8_delayed_scaling.pt  with --fp8-recipe delayed: every FP8 tensor's scale and amax history
`--ckpt-format torch_dist` (Megatron-FSDP) keeps metadata.json and stores model and optimizer as
shards through megatron.core.dist_checkpointing.

Everything is written under `<dir>.tmp` and renamed when complete, then the tracker file is
replaced atomically. Loading uses `torch.load(weights_only=True)` and JSON only, so a checkpoint
from an untrusted source cannot run code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.fp8.config import Fp8Config
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.initialize import DistributedEnv, get_rng_state, set_rng_state

FORMAT_TAG = "megatron-fp8"
FORMAT_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# Flags that change the shapes of parameters: a mismatch cannot be loaded.
ARCHITECTURE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "swiglu",
    "normalization",
    "position_embedding_type",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the fix."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _barrier(env: DistributedEnv) -> None:
    if env.dp_group is not None:
        dist.barrier(group=env.dp_group)


def _json_safe_args(args: argparse.Namespace) -> dict:
    return {
        key: value
        for key, value in vars(args).items()
        if value is None or isinstance(value, (bool, int, float, str, list))
    }


def _config_to_json(config: TransformerConfig) -> dict:
    data = dataclasses.asdict(config)
    data["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return data


def config_from_json(data: dict) -> TransformerConfig:
    data = dict(data)
    data["params_dtype"] = getattr(torch, data["params_dtype"])
    if data.get("fp8") is not None:
        data["fp8"] = Fp8Config(**data["fp8"])
    return TransformerConfig(**data)


def _rng_state_to_plain(state: dict) -> dict:
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


def _rng_state_from_plain(plain: dict) -> dict:
    state = dict(plain)
    name, keys, pos, has_gauss, cached = plain["numpy"]
    state["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    version, internal, gauss = plain["python"]
    state["python"] = (version, tuple(internal), gauss)
    return state


def _metadata(args, run, scheduler, state, env) -> dict:
    return {
        "format": FORMAT_TAG,
        "version": FORMAT_VERSION,
        "ckpt_format": args.ckpt_format,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "skipped_iterations": state.skipped_iterations,
        "nan_iterations": state.nan_iterations,
        "scheduler": scheduler.state_dict(),
        "world_size": env.world_size,
        "model_config": _config_to_json(run.config),
        "args": _json_safe_args(args),
    }


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(args, *, run, scheduler: OptimizerParamScheduler, state, env) -> str:
    """Write iter_XXXXXXX/ under a temporary name, rename it, then update the tracker."""
    final = iteration_dir(args.save, state.iteration)
    tmp = f"{final}.tmp"
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier(env)
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(
            {
                "model": run.model.sharded_state_dict(),
                "optimizer": run.optimizer.sharded_state_dict(),
            },
            os.path.join(tmp, "sharded"),
            process_group=env.dp_group,
        )
    elif env.rank == 0:
        torch.save(run.optimizer.named_main_params(), os.path.join(tmp, "model.pt"))
        torch.save(run.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    # torch_dist: the engine's sharded state already holds the delayed-scaling state.
    fp8_state = _delayed_scaling_state(run) if args.ckpt_format == "torch" else {}
    if fp8_state and env.rank == 0:  # identical on every rank: amaxes are all-reduced
        torch.save(fp8_state, os.path.join(tmp, "fp8_delayed_scaling.pt"))
    rng_path = os.path.join(tmp, "rng", f"rank_{env.rank:05d}.pt")
    torch.save(_rng_state_to_plain(get_rng_state()), rng_path)
    _barrier(env)
    if env.rank == 0:
        _atomic_write_text(
            os.path.join(tmp, "metadata.json"),
            json.dumps(_metadata(args, run, scheduler, state, env), indent=1),
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(os.path.join(args.save, TRACKER_FILENAME), f"{state.iteration}\n")
        print(f" > saved checkpoint at iteration {state.iteration} to {final}", flush=True)
    _barrier(env)
    return final


def _delayed_scaling_state(run) -> dict:
    if run.config.fp8 is None or run.config.fp8.recipe != "delayed":
        return {}
    from megatron.core.fp8 import delayed_scaling_state_dict

    return delayed_scaling_state_dict(run.module)


def _load_delayed_scaling_state(directory: str, run) -> None:
    """Scales and amax histories of --fp8-recipe delayed; other runs have none to restore."""
    path = os.path.join(directory, "fp8_delayed_scaling.pt")
    if not _delayed_scaling_state(run) or not os.path.isfile(path):
        return
    from megatron.core.fp8 import load_delayed_scaling_state_dict

    try:
        load_delayed_scaling_state_dict(run.module, load_tensor_file(path))
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from None


def read_tracker(root: str) -> int | None:
    """The newest complete iteration under root, or None when root holds no checkpoint."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker}: expected an iteration number, found {text[:40]!r}; fix or delete the "
            "file (it names the newest complete iter_XXXXXXX directory)."
        )
    return int(text)


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{directory}: no metadata.json, so this is not a complete megatron-fp8 checkpoint; "
            "point --load at a directory written by --save."
        )
    try:
        metadata = json.load(open(path))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error}); the file is corrupt.") from None
    if metadata.get("format") != FORMAT_TAG:
        raise CheckpointError(
            f"{path}: format {metadata.get('format')!r} is not {FORMAT_TAG!r}; this checkpoint "
            "was written by another program."
        )
    if metadata.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {metadata.get('version')} is not {FORMAT_VERSION}."
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


def _check_architecture(metadata: dict, args: argparse.Namespace, directory: str) -> None:
    saved = metadata.get("args", {})
    for flag in ARCHITECTURE_FLAGS:
        if flag in saved and saved[flag] != getattr(args, flag):
            raise CheckpointError(
                f"{directory}: saved with --{flag.replace('_', '-')} {saved[flag]}, but this run "
                f"has {getattr(args, flag)}; use the checkpoint's value."
            )


def _load_model_tensors(directory: str, run) -> None:
    named = load_tensor_file(os.path.join(directory, "model.pt"))
    expected = run.optimizer.named_main_params()
    missing = sorted(set(expected) - set(named))
    unexpected = sorted(set(named) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}/model.pt: parameters do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); the checkpoint is of another architecture."
        )
    for name, tensor in named.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{directory}/model.pt: {name} has shape {tuple(tensor.shape)}, the model "
                f"expects {tuple(expected[name].shape)}; check the model-size flags."
            )
    run.optimizer.load_main_params(named)


def load_checkpoint(args, *, run, scheduler: OptimizerParamScheduler, env):
    """Restore from --load; returns the TrainState to continue from (None: nothing to load)."""
    from megatron.training.training import TrainState

    iteration = read_tracker(args.load)
    if iteration is None:
        if env.rank == 0:
            print(f" > no checkpoint under --load {args.load}; training from scratch", flush=True)
        return None
    directory = iteration_dir(args.load, iteration)
    metadata = read_metadata(directory)
    _check_architecture(metadata, args, directory)
    if metadata["ckpt_format"] != args.ckpt_format:
        raise CheckpointError(
            f"{directory}: saved with --ckpt-format {metadata['ckpt_format']}, this run uses "
            f"{args.ckpt_format}; pass --ckpt-format {metadata['ckpt_format']}."
        )
    load_optim = not (args.no_load_optim or args.finetune)
    if args.ckpt_format == "torch_dist":
        saved_delayed = metadata["args"].get("fp8_recipe") == "delayed"
        _load_sharded(
            directory, run=run, env=env, load_optim=load_optim, fp8_scaling_state=saved_delayed
        )
    else:
        _load_model_tensors(directory, run)
        if load_optim:
            run.optimizer.load_state_dict(load_tensor_file(os.path.join(directory, "optimizer.pt")))
    if not args.finetune:
        _load_delayed_scaling_state(directory, run)
    if not (args.no_load_rng or args.finetune):
        rng_file = os.path.join(directory, "rng", f"rank_{env.rank:05d}.pt")
        if not os.path.isfile(rng_file):  # resumed at a larger DP size: every rank seeds alike
            rng_file = os.path.join(directory, "rng", "rank_00000.pt")
        set_rng_state(_rng_state_from_plain(load_tensor_file(rng_file)))
    if env.rank == 0:
        print(f" > loaded checkpoint {directory} (iteration {iteration})", flush=True)
    if args.finetune:
        return TrainState()
    if load_optim:
        scheduler.load_state_dict(metadata["scheduler"])
    return TrainState(
        iteration=metadata["iteration"],
        consumed_train_samples=metadata["consumed_train_samples"],
        skipped_iterations=metadata["skipped_iterations"],
        nan_iterations=metadata["nan_iterations"],
    )


def _load_sharded(directory: str, *, run, env, load_optim: bool, fp8_scaling_state: bool) -> None:
    from megatron.core import dist_checkpointing

    # Ask for the delayed-scaling state only when the checkpoint has it (a bf16 or other-recipe
    # checkpoint can resume under delayed scaling, which then starts fresh).
    state = {"model": run.model.sharded_state_dict(fp8_scaling_state=fp8_scaling_state)}
    if load_optim:
        state["optimizer"] = run.optimizer.sharded_state_dict()
    dist_checkpointing.load(state, os.path.join(directory, "sharded"), process_group=env.dp_group)
    run.model.load_sharded_state_dict(state["model"])
    if load_optim:
        run.optimizer.load_sharded_state_dict(state["optimizer"])


def load_state_for_export(
    checkpoint_dir: str, iteration: int | None = None
) -> tuple[dict[str, torch.Tensor], TransformerConfig]:
    """Full fp32 params by model parameter name, and the model config, from any checkpoint.

    `checkpoint_dir` is a --save root (the tracker picks the iteration unless given) or one
    iter_XXXXXXX directory.
    """
    if os.path.isfile(os.path.join(checkpoint_dir, "metadata.json")):
        directory = checkpoint_dir
    else:
        iteration = iteration if iteration is not None else read_tracker(checkpoint_dir)
        if iteration is None:
            raise CheckpointError(
                f"{checkpoint_dir}: no {TRACKER_FILENAME}; pass a --save directory or an "
                "iter_XXXXXXX directory."
            )
        directory = iteration_dir(checkpoint_dir, iteration)
    metadata = read_metadata(directory)
    config = config_from_json(metadata["model_config"])
    if metadata["ckpt_format"] == "torch_dist":
        from megatron.core.dist_checkpointing import load_full_model_state

        return load_full_model_state(os.path.join(directory, "sharded")), config
    return load_tensor_file(os.path.join(directory, "model.pt")), config
