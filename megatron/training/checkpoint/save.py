"""Saving a checkpoint: every rank writes its share under `iter_XXXXXXX.tmp/`, the ranks agree
that all succeeded, rank 0 writes metadata.json last, publishes the directory and moves the
tracker (checkpoint/__init__.py describes the layout). With --async-save the share is copied to CPU
and written by async_save.py's thread; `finish_save` publishes it later.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing
from megatron.core.checkpoint_files import TMP_SUFFIX, fsync_path, publish_dir
from megatron.core.dist_checkpointing.serialization import describe_failure, root_failure
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.training.checkpoint.layout import (
    BUFFERS_FILENAME,
    FORMAT_TAG,
    FORMAT_VERSION,
    TRACKER_FILENAME,
    checkpoint_param_shapes,
    config_to_json,
    delayed_scaling_state,
    first_failing_rank,
    iteration_dir,
    model_buffers,
    read_tracker,
    rng_state_to_plain,
)
from megatron.training.checkpoint.sharded import SHARDED_FORMATS, sharded_state
from megatron.training.checkpoint.space import needed_bytes, space_shortage
from megatron.training.flags.run_config import CheckpointConfig
from megatron.training.initialize import DistributedEnv, get_rng_state
from megatron.training.model_setup import ModelAndOptimizer
from megatron.training.train_state import TrainState

if TYPE_CHECKING:  # async_save.py calls finish_save, so it imports this module
    from megatron.training.checkpoint.async_save import AsyncCheckpointSaver


def _barrier(env: DistributedEnv) -> None:
    if env.all_ranks_group is not None:
        dist.barrier(group=env.all_ranks_group)


def _metadata(config: CheckpointConfig, run, scheduler, state, env) -> dict:
    return {
        "format": FORMAT_TAG,
        "version": FORMAT_VERSION,
        "ckpt_format": config.ckpt_format,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "skipped_iterations": state.skipped_iterations,
        "nan_iterations": state.nan_iterations,
        "scheduler": scheduler.state_dict(),
        # --fp16's loss scale: part of the optimizer state in Megatron-LM, restored with it.
        "grad_scaler": run.grad_scaler.state_dict() if run.grad_scaler is not None else None,
        "world_size": env.world_size,
        "model_config": config_to_json(run.config),
        "args": config.saved_args,
        "resolved_args": config.resolved_args,
        # Checked against the model before any tensor is read (a clear error, not torch's).
        "param_shapes": {
            name: list(shape) for name, shape in checkpoint_param_shapes(run.module).items()
        },
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


def _describe_failure(failure: BaseException | None) -> str:
    """One line for the cause, naming the rank behind a DCP collective error."""
    if failure is None:
        return "see that rank's error line"
    rank, _ = root_failure(failure)
    cause = describe_failure(failure)
    return cause if rank is None else f"rank {rank}: {cause}"


def _kept(config: CheckpointConfig) -> str:
    previous = read_tracker(config.save) if os.path.isdir(config.save) else None
    if previous is None:
        return "no earlier checkpoint exists"
    return f"iteration {previous} stays the checkpoint --load uses"


def _check_space(config: CheckpointConfig, *, run, env, iteration: int, sharded: bool) -> None:
    """Every rank stops before writing when the checkpoint does not fit on the disk."""
    optimizer = not config.no_save_optim
    if sharded:
        state = sharded_state(run, optimizer=optimizer)
    else:
        state = [run.optimizer.named_main_params(), run.optimizer.state_dict() if optimizer else {}]
    needed = needed_bytes(state, rank=env.rank, group=env.all_ranks_group, device=env.device)
    shortage = space_shortage(config.save, needed)
    failure = CheckpointSaveError(shortage) if shortage else None
    if first_failing_rank(env, failure) < 0:
        return
    # A rank with room names the disk it saw all the same: the ranks stop together.
    shortage = shortage or f"no space left on device on another rank: {config.save}"
    raise CheckpointSaveError(
        f"{shortage}; nothing of iteration {iteration} was written and {_kept(config)}. "
        f"Free space, then resume with --load {config.save}."
    )


def _save_failed(
    config: CheckpointConfig, *, env, iteration: int, tmp: str, failure, failed_rank: int
) -> None:
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(env)
    kept = _kept(config)
    cause = _describe_failure(failure)
    if failure is not None:
        # torch.save reports a full disk as a zip-writer position error, not ENOSPC: say
        # what the disk holds so the cause is plain either way.
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(config.save).free
            cause += f"; {free / 2**20:.2f} MiB free on the disk of {config.save}"
    raise CheckpointSaveError(
        f"saving iteration {iteration} to {iteration_dir(config.save, iteration)} "
        f"failed on rank {failed_rank} ({cause}); the partial {os.path.basename(tmp)} was "
        f"removed and {kept}. Free space or fix the directory's permissions, then resume "
        f"with --load {config.save}."
    ) from failure


def _write_checkpoint_files(config: CheckpointConfig, *, run, env, tmp: str) -> None:
    """Every rank's share of iteration `tmp`: model and optimizer state, FP8 state, RNG."""
    if config.ckpt_format in SHARDED_FORMATS:
        sharded = sharded_state(run, optimizer=not config.no_save_optim)
        dist_checkpointing.save(
            sharded, os.path.join(tmp, "sharded"), process_group=env.all_ranks_group
        )
    elif env.rank == 0:
        _save_tensor_file(run.optimizer.named_main_params(), os.path.join(tmp, "model.pt"))
        if not config.no_save_optim:
            _save_tensor_file(run.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    _write_small_files(
        config,
        env=env,
        tmp=tmp,
        fp8_state=_fp8_file_state(config, run, env),
        rng_state=get_rng_state(),
        buffers=model_buffers(run),
    )


def _fp8_file_state(config: CheckpointConfig, run, env) -> dict:
    """What rank 0 writes to fp8_delayed_scaling.pt: every rank's state (experts: each
    expert-parallel rank's own). Megatron-FSDP's sharded state already holds it."""
    if config.use_megatron_fsdp:
        return {}
    state = delayed_scaling_state(run)
    if not state or env.all_ranks_group is None or run.config.expert_model_parallel_size == 1:
        return state
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, state, group=env.all_ranks_group)
    merged: dict = {}
    for rank_state in gathered:  # dense entries agree over ranks; expert keys are global
        for name, module_state in rank_state.items():
            merged.setdefault(name, {}).update(module_state)
    return merged


def _write_small_files(
    config: CheckpointConfig, *, env, tmp: str, fp8_state: dict, rng_state: dict, buffers: dict
) -> None:
    if fp8_state and env.rank == 0:  # identical on every rank: amaxes are all-reduced
        _save_tensor_file(fp8_state, os.path.join(tmp, "fp8_delayed_scaling.pt"))
    if buffers and env.rank == 0:  # identical on every rank (expert bias: global counts)
        _save_tensor_file(buffers, os.path.join(tmp, BUFFERS_FILENAME))
    if not config.no_save_rng:
        rng_path = os.path.join(tmp, "rng", f"rank_{env.rank:05d}.pt")
        _save_tensor_file(rng_state_to_plain(rng_state), rng_path)


def _start_async_write(
    config: CheckpointConfig, *, run, env, tmp: str, iteration: int, metadata: dict, saver
):
    """Copy this rank's share to CPU now (training then changes the live tensors) and hand
    the copy to `saver`'s writer thread; the metadata was taken at the same moment."""
    staged = saver.stage(sharded_state(run, optimizer=not config.no_save_optim), name="sharded")
    fp8_state = saver.stage(_fp8_file_state(config, run, env), name="fp8")
    # A blocking host copy (a few values): the loop updates expert biases before the next
    # optimizer step, which is all the staged copies are ordered before.
    buffers = {name: buf.detach().to("cpu", copy=True) for name, buf in model_buffers(run).items()}
    rng_state = get_rng_state()

    def write(group) -> None:
        dist_checkpointing.save(staged, os.path.join(tmp, "sharded"), process_group=group)
        if saver.fault is not None:
            saver.fault(tmp, iteration)
        _write_small_files(
            config, env=env, tmp=tmp, fp8_state=fp8_state, rng_state=rng_state, buffers=buffers
        )

    saver.start(iteration=iteration, metadata=metadata, write=write)


def _fresh_tmp_dir(config: CheckpointConfig, *, env: DistributedEnv, iteration: int) -> str:
    """Rank 0 empties and creates `iter_XXXXXXX.tmp/`; every rank learns whether it could."""
    tmp = f"{iteration_dir(config.save, iteration)}{TMP_SUFFIX}"
    failure: BaseException | None = None
    try:
        if env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng") if not config.no_save_rng else tmp)
    except OSError as error:
        failure = error
    failed_rank = first_failing_rank(env, failure)
    if failed_rank >= 0:
        _save_failed(
            config, env=env, iteration=iteration, tmp=tmp, failure=failure, failed_rank=failed_rank
        )
    return tmp


def save_checkpoint(
    config: CheckpointConfig,
    *,
    run: ModelAndOptimizer,
    scheduler: OptimizerParamScheduler,
    state: TrainState,
    env: DistributedEnv,
    async_saver: AsyncCheckpointSaver | None = None,
) -> str | None:
    """Write iter_XXXXXXX/ under a temporary name, publish it, then update the tracker.

    A failure on any rank (OSError such as ENOSPC, or torch.distributed.checkpoint's
    collective error wrapping one) is agreed on by every rank before anything is published;
    all of them then raise CheckpointSaveError naming the path and the iteration.

    With `async_saver` (megatron/training/checkpoint/async_save.py, --async-save) the files are
    written by its thread from a CPU copy and this returns None at once; the saver publishes
    the directory and moves the tracker later, when every rank's write completed."""
    started = time.perf_counter()
    if async_saver is not None:
        async_saver.finalize(blocking=True)  # one save in flight at a time
    sharded = config.ckpt_format in SHARDED_FORMATS or async_saver is not None
    _check_space(config, run=run, env=env, iteration=state.iteration, sharded=sharded)
    tmp = _fresh_tmp_dir(config, env=env, iteration=state.iteration)
    metadata = _metadata(config, run, scheduler, state, env)
    if async_saver is not None:
        _start_async_write(
            config,
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
    failure: BaseException | None = None
    try:
        _write_checkpoint_files(config, run=run, env=env, tmp=tmp)
    # DCP's collective CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - reported, re-raised
        failure = error
    final = finish_save(
        config, env=env, iteration=state.iteration, metadata=metadata, failure=failure
    )
    if env.rank == 0:
        print(
            f" > save of iteration {state.iteration} blocked training {_ms_since(started):.1f} ms",
            flush=True,
        )
    return final


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0


def finish_save(
    config: CheckpointConfig,
    *,
    env: DistributedEnv,
    iteration: int,
    metadata: dict,
    failure: BaseException | None,
) -> str:
    """After every rank wrote its files (or failed to): agree, write metadata.json, publish
    the directory, move the tracker. Collective over the data-parallel group."""
    final = iteration_dir(config.save, iteration)
    tmp = f"{final}{TMP_SUFFIX}"
    failed_rank = first_failing_rank(env, failure)
    if failed_rank < 0 and env.rank == 0:
        try:
            if not config.no_save_rng:
                fsync_path(os.path.join(tmp, "rng"))
            # Written last (and fsyncs tmp/): a directory with metadata.json is complete.
            _atomic_write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata, indent=1))
            publish_dir(tmp, final)
        except OSError as error:
            failure = error
    if failed_rank < 0:
        failed_rank = first_failing_rank(env, failure)
    if failed_rank >= 0:
        _save_failed(
            config, env=env, iteration=iteration, tmp=tmp, failure=failure, failed_rank=failed_rank
        )
    tracker_failure = None
    if env.rank == 0:
        try:
            _atomic_write_text(os.path.join(config.save, TRACKER_FILENAME), f"{iteration}\n")
        except OSError as error:  # the new directory is complete; the old tracker still loads
            tracker_failure = error
            with contextlib.suppress(OSError):
                os.remove(os.path.join(config.save, TRACKER_FILENAME + TMP_SUFFIX))
    if first_failing_rank(env, tracker_failure) >= 0:
        previous = read_tracker(config.save)
        raise CheckpointSaveError(
            f"iteration {iteration} was written to {final} but "
            f"{os.path.join(config.save, TRACKER_FILENAME)} could not be updated "
            f"({tracker_failure}); it still names iteration {previous}. Free space, then "
            f"resume with --load {config.save} --ckpt-step {iteration}."
        ) from tracker_failure
    if env.rank == 0:
        print(f" > saved checkpoint at iteration {iteration} to {final}", flush=True)
    return final
