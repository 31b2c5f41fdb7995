"""Checkpoints: `latest_checkpointed_iteration.txt` plus `iter_0000100/`, written atomically.

Layout of one `iter_XXXXXXX/` directory (`--ckpt-format torch`):
  metadata.json       format tag, iteration, consumed samples, counters, scheduler state, the
                      model config and the flags (plain JSON)
  model.pt            {param name: fp32 tensor}, the main (fp32) values of every parameter
  optimizer.pt        the optimizer state (tensors and numbers only; not with --no-save-optim)
  rng/rank_00000.pt   each rank's RNG states (tensors and numbers only; not with --no-save-rng)
  fp8_delayed_scaling.pt  with --fp8-recipe delayed: every FP8 tensor's scale and amax history
`--ckpt-format torch_dist` (DDP or Megatron-FSDP; `fsdp_dtensor` is Megatron-FSDP's name for the
same layout) keeps metadata.json and stores model and optimizer under `sharded/` through
megatron.core.dist_checkpointing (megatron/training/sharded_checkpoint.py says which state);
with --async-save those files are written by a background thread (async_checkpoint.py) and
published, tracker last, once every rank's write completed.

Everything is written under `<dir>.tmp`, fsynced, and published when complete: a previous
`<dir>` (a re-save of the same iteration) is renamed to `<dir>.old` first and deleted only once
the new one is in place (megatron/core/checkpoint_files.py); then the tracker file is replaced
atomically. A kill between those renames leaves `<dir>.old` and no `<dir>`: that copy is complete,
and loading uses it. Loading a `torch` checkpoint uses `torch.load(weights_only=True)` and JSON
only, so one from an untrusted source cannot run code (torch_dist's `.metadata`, read by
torch.distributed.checkpoint, is read through a restricted unpickler); a missing, truncated or
malformed file, or one that does not fit this run's flags, raises CheckpointError naming the
file and the fix before training.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.checkpoint_files import (
    TMP_SUFFIX,
    CheckpointError,
    fsync_path,
    publish_dir,
    resolve_published_dir,
)
from megatron.core.dist_checkpointing.serialization import describe_failure, root_failure
from megatron.core.fp8.config import Fp8Config
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.initialize import DistributedEnv, get_rng_state, set_rng_state
from megatron.training.sharded_checkpoint import (
    SHARDED_FORMATS,
    load_sharded_state,
    sharded_state,
)

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
# What --use-checkpoint-args takes from the checkpoint (Megatron-LM's load_args_from_checkpoint
# takes the same model flags), besides the vocabulary rows.
CHECKPOINT_MODEL_ARGS = ARCHITECTURE_FLAGS + (
    "group_query_attention",
    "max_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "norm_epsilon",
    "make_vocab_size_divisible_by",
)
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
        # --fp16's loss scale: part of the optimizer state in Megatron-LM, restored with it.
        "grad_scaler": run.grad_scaler.state_dict() if run.grad_scaler is not None else None,
        "world_size": env.world_size,
        "model_config": _config_to_json(run.config),
        "args": _json_safe_args(args),
        # Checked against the model before any tensor is read (a clear error, not torch's).
        "param_shapes": {name: list(p.shape) for name, p in run.module.named_parameters()},
    }


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}{TMP_SUFFIX}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def _save_tensor_file(obj, path: str) -> None:
    """torch.save, then fsync: the rename that publishes the checkpoint must not outrun the data."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, a permission, a vanished directory): its
    partial .tmp is removed and the previous checkpoint stays the one --load uses.
    pretrain_gpt.py prints it as one `error:` line per rank and exits with status 1."""


def _first_failure(env: DistributedEnv, failure: BaseException | None) -> int:
    """Every rank's verdict at once: the lowest failing rank, or -1 when all succeeded. It
    stands in for the barrier between the save's phases, so no rank waits on one that gave up."""
    if env.dp_group is None:
        return env.rank if failure is not None else -1
    # gloo and NCCL both reduce a float MIN; ranks that succeeded send the world size.
    code = torch.tensor(
        [float(env.rank if failure is not None else env.world_size)], device=env.device
    )
    dist.all_reduce(code, op=dist.ReduceOp.MIN, group=env.dp_group)
    failed = int(code.item())
    return failed if failed < env.world_size else -1


def _describe_failure(failure: BaseException | None) -> str:
    """One line for the cause, naming the rank behind a DCP collective error."""
    if failure is None:
        return "see that rank's error line"
    rank, _ = root_failure(failure)
    cause = describe_failure(failure)
    return cause if rank is None else f"rank {rank}: {cause}"


def _save_failed(args, *, env, iteration: int, tmp: str, failure, failed_rank: int) -> None:
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(env)
    previous = read_tracker(args.save) if os.path.isdir(args.save) else None
    kept = (
        f"iteration {previous} stays the checkpoint --load uses"
        if previous is not None
        else "no earlier checkpoint exists"
    )
    cause = _describe_failure(failure)
    if failure is not None:
        # torch.save reports a full disk as a zip-writer position error, not ENOSPC: say
        # what the disk holds so the cause is plain either way.
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(args.save).free
            cause += f"; {free / 2**20:.2f} MiB free on the disk of {args.save}"
    raise CheckpointSaveError(
        f"saving iteration {iteration} to {iteration_dir(args.save, iteration)} "
        f"failed on rank {failed_rank} ({cause}); the partial {os.path.basename(tmp)} was "
        f"removed and {kept}. Free space or fix the directory's permissions, then resume "
        f"with --load {args.save}."
    ) from failure


def _write_checkpoint_files(args, *, run, env, tmp: str) -> None:
    """Every rank's share of iteration `tmp`: model and optimizer state, FP8 state, RNG."""
    if args.ckpt_format in SHARDED_FORMATS:
        from megatron.core import dist_checkpointing

        sharded = sharded_state(run, optimizer=not args.no_save_optim)
        dist_checkpointing.save(sharded, os.path.join(tmp, "sharded"), process_group=env.dp_group)
    elif env.rank == 0:
        _save_tensor_file(run.optimizer.named_main_params(), os.path.join(tmp, "model.pt"))
        if not args.no_save_optim:
            _save_tensor_file(run.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    _write_small_files(
        args, env=env, tmp=tmp, fp8_state=_fp8_file_state(args, run), rng_state=get_rng_state()
    )


def _fp8_file_state(args, run) -> dict:
    # Megatron-FSDP's sharded state already holds the delayed-scaling state.
    return {} if args.use_megatron_fsdp else _delayed_scaling_state(run)


def _write_small_files(args, *, env, tmp: str, fp8_state: dict, rng_state: dict) -> None:
    if fp8_state and env.rank == 0:  # identical on every rank: amaxes are all-reduced
        _save_tensor_file(fp8_state, os.path.join(tmp, "fp8_delayed_scaling.pt"))
    if not args.no_save_rng:
        rng_path = os.path.join(tmp, "rng", f"rank_{env.rank:05d}.pt")
        _save_tensor_file(_rng_state_to_plain(rng_state), rng_path)


def _start_async_write(args, *, run, env, tmp: str, iteration: int, metadata: dict, saver):
    """Copy this rank's share to CPU now (training then changes the live tensors) and hand
    the copy to `saver`'s writer thread; the metadata was taken at the same moment."""
    from megatron.core import dist_checkpointing

    staged = saver.stage(sharded_state(run, optimizer=not args.no_save_optim), name="sharded")
    fp8_state = saver.stage(_fp8_file_state(args, run), name="fp8")
    rng_state = get_rng_state()

    def write(group) -> None:
        dist_checkpointing.save(staged, os.path.join(tmp, "sharded"), process_group=group)
        saver.test_hold(tmp, iteration)
        _write_small_files(args, env=env, tmp=tmp, fp8_state=fp8_state, rng_state=rng_state)

    saver.start(iteration=iteration, metadata=metadata, write=write)


def save_checkpoint(
    args, *, run, scheduler: OptimizerParamScheduler, state, env, async_saver=None
) -> str | None:
    """Write iter_XXXXXXX/ under a temporary name, publish it, then update the tracker.

    A failure on any rank (OSError such as ENOSPC, or torch.distributed.checkpoint's
    collective error wrapping one) is agreed on by every rank before anything is published;
    all of them then raise CheckpointSaveError naming the path and the iteration.

    With `async_saver` (megatron/training/async_checkpoint.py, --async-save) the files are
    written by its thread from a CPU copy and this returns None at once; the saver publishes
    the directory and moves the tracker later, when every rank's write completed."""
    started = time.perf_counter()
    if async_saver is not None:
        async_saver.finalize(blocking=True)  # one save in flight at a time
    final = iteration_dir(args.save, state.iteration)
    tmp = f"{final}{TMP_SUFFIX}"
    failure: BaseException | None = None
    try:
        if env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng") if not args.no_save_rng else tmp)
    except OSError as error:
        failure = error
    failed_rank = _first_failure(env, failure)
    if failed_rank >= 0:
        _save_failed(
            args,
            env=env,
            iteration=state.iteration,
            tmp=tmp,
            failure=failure,
            failed_rank=failed_rank,
        )
    metadata = _metadata(args, run, scheduler, state, env)
    if async_saver is not None:
        _start_async_write(
            args,
            run=run,
            env=env,
            tmp=tmp,
            iteration=state.iteration,
            metadata=metadata,
            saver=async_saver,
        )
        if env.rank == 0:  # benchmarks/async_save.sh reads this line
            print(
                f" > writing checkpoint of iteration {state.iteration} asynchronously "
                f"(blocked training {_ms_since(started):.1f} ms)",
                flush=True,
            )
        return None
    try:
        _write_checkpoint_files(args, run=run, env=env, tmp=tmp)
    # DCP's collective CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - reported, re-raised
        failure = error
    final = finish_save(
        args, env=env, iteration=state.iteration, metadata=metadata, failure=failure
    )
    if env.rank == 0:
        print(
            f" > save of iteration {state.iteration} blocked training {_ms_since(started):.1f} ms",
            flush=True,
        )
    return final


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0


def finish_save(args, *, env, iteration: int, metadata: dict, failure: BaseException | None) -> str:
    """After every rank wrote its files (or failed to): agree, write metadata.json, publish
    the directory, move the tracker. Collective over the data-parallel group."""
    final = iteration_dir(args.save, iteration)
    tmp = f"{final}{TMP_SUFFIX}"
    failed_rank = _first_failure(env, failure)
    if failed_rank < 0 and env.rank == 0:
        try:
            if not args.no_save_rng:
                fsync_path(os.path.join(tmp, "rng"))
            # Written last (and fsyncs tmp/): a directory with metadata.json is complete.
            _atomic_write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata, indent=1))
            publish_dir(tmp, final)
        except OSError as error:
            failure = error
    if failed_rank < 0:
        failed_rank = _first_failure(env, failure)
    if failed_rank >= 0:
        _save_failed(
            args, env=env, iteration=iteration, tmp=tmp, failure=failure, failed_rank=failed_rank
        )
    tracker_failure = None
    if env.rank == 0:
        try:
            _atomic_write_text(os.path.join(args.save, TRACKER_FILENAME), f"{iteration}\n")
        except OSError as error:  # the new directory is complete; the old tracker still loads
            tracker_failure = error
            with contextlib.suppress(OSError):
                os.remove(os.path.join(args.save, TRACKER_FILENAME + TMP_SUFFIX))
    if _first_failure(env, tracker_failure) >= 0:
        previous = read_tracker(args.save)
        raise CheckpointSaveError(
            f"iteration {iteration} was written to {final} but "
            f"{os.path.join(args.save, TRACKER_FILENAME)} could not be updated "
            f"({tracker_failure}); it still names iteration {previous}. Free space, then "
            f"resume with --load {args.save} --ckpt-step {iteration}."
        ) from tracker_failure
    if env.rank == 0:
        print(f" > saved checkpoint at iteration {iteration} to {final}", flush=True)
    return final


def _delayed_scaling_state(run) -> dict:
    if run.config.fp8 is None or not run.config.fp8.spec.delayed:
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
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: {error}") from None


_ITERATION_DIR = re.compile(r"iter_(\d{7})(\.old)?")


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


def _check_saved_flags(metadata: dict, args: argparse.Namespace, *, directory: str) -> None:
    """Flags whose saved value this run must share: shapes, the format, and (when the
    optimizer state is loaded) the optimizer, whose state keys differ (Adam moments vs SGD
    momentum). --no-load-optim and --finetune start a fresh optimizer, so any one is fine."""
    saved = metadata["args"]
    for flag in ARCHITECTURE_FLAGS:
        if flag in saved and saved[flag] != getattr(args, flag):
            raise CheckpointError(
                f"{directory}: saved with --{flag.replace('_', '-')} {saved[flag]}, but this run "
                f"has {getattr(args, flag)}; use the checkpoint's value."
            )
    same_layout = {metadata["ckpt_format"], args.ckpt_format} <= set(SHARDED_FORMATS)
    if metadata["ckpt_format"] != args.ckpt_format and not same_layout:
        raise CheckpointError(
            f"{directory}: saved with --ckpt-format {metadata['ckpt_format']}, this run uses "
            f"{args.ckpt_format}; pass --ckpt-format {metadata['ckpt_format']}."
        )
    engine_changed = bool(saved.get("use_megatron_fsdp")) != bool(args.use_megatron_fsdp)
    if engine_changed and saved.get("fp8_recipe") == "delayed" and not args.finetune:
        # DDP keeps the delayed-scaling state in fp8_delayed_scaling.pt, Megatron-FSDP in its
        # sharded state: neither engine finds the other's.
        raise CheckpointError(
            f"{directory}: a --fp8-recipe delayed checkpoint saved "
            f"{'with' if saved.get('use_megatron_fsdp') else 'without'} --use-megatron-fsdp; "
            "resume it under the same engine, or pass --finetune to load only the weights."
        )
    saved_len = saved.get("fp8_amax_history_len")
    delayed_both = saved.get("fp8_recipe") == "delayed" and args.fp8_recipe == "delayed"
    if delayed_both and not args.finetune and saved_len != args.fp8_amax_history_len:
        raise CheckpointError(
            f"{directory}: saved with --fp8-amax-history-len {saved_len}, but this run has "
            f"{args.fp8_amax_history_len}; the saved amax histories ({saved_len} slots per FP8 "
            f"tensor) cannot be loaded into {args.fp8_amax_history_len}. Pass "
            f"--fp8-amax-history-len {saved_len}, or --finetune to load only the weights and "
            "start the delayed-scaling state fresh."
        )
    if (
        not args.finetune
        and (args.train_samples is not None or saved.get("train_samples") is not None)
        and saved.get("global_batch_size", args.global_batch_size) != args.global_batch_size
    ):
        raise CheckpointError(
            f"{directory}: a --train-samples run saved with --global-batch-size "
            f"{saved['global_batch_size']}, but this run has {args.global_batch_size} (given, or "
            "micro-batch x data-parallel size); its iteration count and schedule are counted in "
            f"batches of {saved['global_batch_size']}. Pass --global-batch-size "
            f"{saved['global_batch_size']}."
        )
    load_optim = not (args.no_load_optim or args.finetune)
    # Megatron-LM's rule: a checkpoint without a state needs the flag that skips loading it.
    if load_optim and saved.get("no_save_optim", False):
        raise CheckpointError(
            f"{directory}: saved with --no-save-optim, so it holds no optimizer state; pass "
            "--no-load-optim (weights and iteration restored; optimizer and learning-rate "
            "schedule start fresh, as in Megatron-LM) or --finetune."
        )
    if not (args.no_load_rng or args.finetune) and saved.get("no_save_rng", False):
        raise CheckpointError(
            f"{directory}: saved with --no-save-rng, so it holds no RNG states; pass "
            "--no-load-rng (this run's --seed seeds the RNGs) or --finetune."
        )
    if load_optim and saved.get("optimizer", args.optimizer) != args.optimizer:
        raise CheckpointError(
            f"{directory}: saved with --optimizer {saved['optimizer']}, but this run has "
            f"--optimizer {args.optimizer}, which cannot use its state; pass --optimizer "
            f"{saved['optimizer']}, or --no-load-optim (or --finetune) to start "
            f"{args.optimizer} from fresh state."
        )


def _shape_fix(name: str, saved: tuple, expected: tuple, saved_args: dict) -> str:
    """The flag behind a parameter's shape (what a user changed), named for the message."""
    if name.endswith("word_embeddings.weight") or name.startswith("output_layer."):
        vocab = saved_args.get("vocab_size")
        return (
            f"the padded vocabulary differs (checkpoint {saved[0]}, this run {expected[0]}): "
            f"pass {f'--vocab-size {vocab}' if vocab else 'the checkpoint tokenizer'} and "
            f"--make-vocab-size-divisible-by {saved_args.get('make_vocab_size_divisible_by')}, "
            "as saved"
        )
    if name.endswith("position_embeddings.weight"):
        return (
            f"the learned position table differs (checkpoint {saved[0]} positions, this run "
            f"{expected[0]}): pass --max-position-embeddings {saved[0]} (it defaults to "
            f"--seq-length) with a --seq-length of at most {saved[0]}"
        )
    return (
        "check the model-size flags (--hidden-size, --ffn-hidden-size, --num-attention-heads, "
        "--num-query-groups, --kv-channels) against the checkpoint's metadata.json 'args'"
    )


def _check_shapes(
    saved: dict[str, tuple], expected: dict[str, tuple], *, source: str, saved_args: dict
) -> None:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: parameters do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); the checkpoint is of another architecture."
        )
    for name, shape in expected.items():
        if saved[name] != shape:
            raise CheckpointError(
                f"{source}: {name} has shape {saved[name]} in the checkpoint, the model "
                f"expects {shape}; {_shape_fix(name, saved[name], shape, saved_args)}."
            )


def _check_saved_param_shapes(metadata: dict, run, *, directory: str) -> None:
    """metadata.json's param shapes against the model, before any tensor is read (checkpoints
    from before shapes were recorded skip this; model.pt's own shapes are still checked)."""
    if "param_shapes" not in metadata:
        return
    source = os.path.join(directory, "metadata.json")
    try:
        saved = {
            name: tuple(int(d) for d in shape) for name, shape in metadata["param_shapes"].items()
        }
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(
            f"{source}: 'param_shapes' is not {{name: [sizes]}}; the file is corrupt or was "
            "edited. Load another iteration."
        ) from None
    expected = {name: tuple(p.shape) for name, p in run.module.named_parameters()}
    _check_shapes(saved, expected, source=source, saved_args=metadata["args"])


def _read_model_file(directory: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, "model.pt")
    named = load_tensor_file(path)
    if not isinstance(named, dict) or not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise CheckpointError(
            f"{path}: not a {{param name: tensor}} dict; the file is corrupt. Load another "
            "iteration."
        )
    return named


def _load_model_tensors(directory: str, run, saved_args: dict) -> None:
    named = _read_model_file(directory)
    expected = run.optimizer.named_main_params()
    _check_shapes(
        {name: tuple(t.shape) for name, t in named.items()},
        {name: tuple(t.shape) for name, t in expected.items()},
        source=os.path.join(directory, "model.pt"),
        saved_args=saved_args,
    )
    run.optimizer.load_main_params(named)


def _load_optimizer_file(directory: str, run) -> None:
    path = os.path.join(directory, "optimizer.pt")
    state = load_tensor_file(path)
    try:
        run.optimizer.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise CheckpointError(
            f"{path}: not this run's optimizer state ({type(error).__name__}: {error}); the "
            "file is corrupt. Load another iteration, or pass --no-load-optim."
        ) from None


def _load_rng_state(directory: str, env) -> None:
    rng_file = os.path.join(directory, "rng", f"rank_{env.rank:05d}.pt")
    if not os.path.isfile(rng_file):  # resumed at a larger DP size: every rank seeds alike
        rng_file = os.path.join(directory, "rng", "rank_00000.pt")
    plain = load_tensor_file(rng_file)
    try:
        set_rng_state(_rng_state_from_plain(plain))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise CheckpointError(
            f"{rng_file}: not an RNG state ({type(error).__name__}: {error}); the file is "
            "corrupt. Load another iteration, or pass --no-load-rng."
        ) from None


# LRScheduleConfig fields, by the flag that sets each (for the mismatch message).
_SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_iters": "--lr-warmup-iters (or --lr-warmup-fraction)",
    "warmup_init": "--lr-warmup-init",
    "decay_iters": "--lr-decay-iters (default --train-iters)",
    "decay_style": "--lr-decay-style",
    "wsd_decay_iters": "--lr-wsd-decay-iters",
    "wsd_decay_style": "--lr-wsd-decay-style",
}


def _load_scheduler(
    args, metadata: dict, scheduler: OptimizerParamScheduler, directory: str
) -> None:
    """Restore the schedule's step count. As in Megatron-LM, a schedule whose flags differ from
    the checkpoint's (a longer --train-iters moves the decay) is refused unless the run says
    which one to use."""
    state = metadata.get("scheduler")
    try:
        differences = scheduler.config_differences(state)
        if args.override_opt_param_scheduler:
            differences = []
        if differences and not args.use_checkpoint_opt_param_scheduler:
            listed = "; ".join(
                f"{_SCHEDULE_FLAGS.get(name, name)}: saved {saved!r}, now {now!r}"
                for name, saved, now in differences
            )
            raise CheckpointError(
                f"{directory}: the learning-rate schedule differs from the checkpoint's "
                f"({listed}). Pass the saved values, or --override-opt_param-scheduler to use "
                "this run's flags, or --use-checkpoint-opt_param-scheduler to keep the "
                "checkpoint's schedule."
            )
        scheduler.load_state_dict(state, use_saved_config=args.use_checkpoint_opt_param_scheduler)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"{directory}/metadata.json: 'scheduler' is not a learning-rate schedule state "
            f"({type(error).__name__}: {error}); the file is corrupt or was edited. Load "
            "another iteration, or pass --no-load-optim to restart the schedule."
        ) from None


def load_checkpoint(args, *, run, scheduler: OptimizerParamScheduler, env):
    """Restore from --load; returns the TrainState to continue from (None: nothing to load).

    pretrain has already run check_load_path (before building the model). Every other check
    that needs no tensor (tracker, metadata, saved flags and parameter shapes) runs before any
    file is read into the model or optimizer."""
    from megatron.training.training import TrainState

    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    if iteration is None:
        if env.rank == 0:
            print(f" > no checkpoint under --load {args.load}; training from scratch", flush=True)
        return None
    directory = resolve_iteration_dir(args.load, iteration)
    metadata = read_metadata(directory)
    _check_saved_flags(metadata, args, directory=directory)
    _check_saved_param_shapes(metadata, run, directory=directory)
    load_optim = not (args.no_load_optim or args.finetune)
    if args.ckpt_format in SHARDED_FORMATS:
        # --finetune loads weights only, in both formats: no delayed-scaling state either.
        saved_delayed = metadata["args"].get("fp8_recipe") == "delayed" and not args.finetune
        _load_sharded(
            directory, run=run, env=env, load_optim=load_optim, fp8_scaling_state=saved_delayed
        )
    # Every rank reads these files on its own (its RNG file is its alone): a bad file on one
    # rank must stop all of them together, not leave the others in the first collective.
    failure: CheckpointError | None = None
    try:
        if args.ckpt_format not in SHARDED_FORMATS:
            _load_model_tensors(directory, run, metadata["args"])
            if load_optim:
                _load_optimizer_file(directory, run)
        if not args.finetune:
            _load_delayed_scaling_state(directory, run)
        if not (args.no_load_rng or args.finetune):
            _load_rng_state(directory, env)
    except CheckpointError as error:
        failure = error
    _raise_if_any_rank_failed(env, failure)
    if env.rank == 0:
        print(f" > loaded checkpoint {directory} (iteration {iteration})", flush=True)
    if args.finetune:
        return TrainState()
    if load_optim:
        _load_scheduler(args, metadata, scheduler, directory)
        if run.grad_scaler is not None and metadata.get("grad_scaler") is not None:
            run.grad_scaler.load_state_dict(metadata["grad_scaler"])
    return TrainState(
        iteration=metadata["iteration"],
        consumed_train_samples=metadata["consumed_train_samples"],
        skipped_iterations=metadata["skipped_iterations"],
        nan_iterations=metadata["nan_iterations"],
    )


def _raise_if_any_rank_failed(env: DistributedEnv, failure: CheckpointError | None) -> None:
    """The same CheckpointError on every rank when any rank's load failed: the lowest failing
    rank's message, which names its file."""
    if env.dp_group is None:
        if failure is not None:
            raise failure
        return
    if _first_failure(env, failure) < 0:
        return
    messages: list[str | None] = [None] * env.world_size
    dist.all_gather_object(messages, None if failure is None else str(failure), group=env.dp_group)
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise CheckpointError(message if rank == env.rank else f"(on rank {rank}) {message}")


def _load_sharded(directory: str, *, run, env, load_optim: bool, fp8_scaling_state: bool) -> None:
    from megatron.core import dist_checkpointing

    # Ask for the delayed-scaling state only when the checkpoint has it (a bf16 or other-recipe
    # checkpoint can resume under delayed scaling, which then starts fresh).
    state = sharded_state(run, optimizer=load_optim, fp8_scaling_state=fp8_scaling_state)
    # Raises CheckpointError for a missing, truncated or mismatched shard or .metadata.
    dist_checkpointing.load(state, os.path.join(directory, "sharded"), process_group=env.dp_group)
    try:
        load_sharded_state(run, state)
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{directory}/sharded: {error}") from None


def load_args_from_checkpoint(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: set the model flags and the vocabulary rows (padded_vocab_size)
    from the checkpoint --load names, before validation; returns one line per flag changed.
    CheckpointError names the file when there is no checkpoint to read them from."""
    if args.load is None:
        raise CheckpointError("--use-checkpoint-args reads the flags of --load DIR; pass --load.")
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    if iteration is None:
        raise CheckpointError(
            f"--use-checkpoint-args: --load {args.load} holds no {TRACKER_FILENAME}, so there "
            "are no saved flags to use; pass a --save directory (or drop the flag)."
        )
    metadata = read_metadata(resolve_iteration_dir(args.load, iteration))
    saved = metadata["args"]
    changed = []
    for name in CHECKPOINT_MODEL_ARGS:
        if name in saved and saved[name] != getattr(args, name):
            changed.append(
                f"--{name.replace('_', '-')} {saved[name]} (command line: {getattr(args, name)})"
            )
            setattr(args, name, saved[name])
    vocab_rows = metadata["model_config"].get("vocab_size")
    if isinstance(vocab_rows, int):
        args.padded_vocab_size = vocab_rows
    if args.ckpt_format is None:
        args.ckpt_format = metadata["ckpt_format"]
    return changed


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
        from megatron.core.dist_checkpointing import load_full_model_params

        return load_full_model_params(os.path.join(directory, "sharded")), config
    return _read_model_file(directory), config
