"""Loading a checkpoint into a run (--load): the checks of checkpoint/checks.py first, then
model and optimizer state (torch files or the sharded state), FP8 delayed-scaling state, RNG
states, the learning-rate schedule and the loss scale; returns the TrainState to continue from.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.checkpoint_files import CheckpointError
from megatron.core.fp8 import load_delayed_scaling_state_dict
from megatron.core.fp8.recipe import names_delayed_scaling
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.training.checkpoint.checks import (
    check_saved_flags,
    check_saved_param_shapes,
    check_shapes,
    schedule_mismatch,
)
from megatron.training.checkpoint.layout import (
    delayed_scaling_state,
    first_failing_rank,
    load_tensor_file,
    model_buffers,
    read_buffers_file,
    read_metadata,
    read_model_file,
    read_tracker,
    resolve_iteration_dir,
    rng_state_from_plain,
    saved_run_flags,
)
from megatron.training.checkpoint.sharded import SHARDED_FORMATS, load_sharded_state, sharded_state
from megatron.training.flags.run_config import CheckpointConfig
from megatron.training.initialize import DistributedEnv, set_rng_state
from megatron.training.model_setup import ModelAndOptimizer
from megatron.training.train_state import TrainState


def _load_delayed_scaling_state(directory: str, run) -> None:
    """Scales and amax histories of --fp8-recipe delayed; other runs have none to restore."""
    path = os.path.join(directory, "fp8_delayed_scaling.pt")
    if not delayed_scaling_state(run) or not os.path.isfile(path):
        return
    try:
        load_delayed_scaling_state_dict(run.module, load_tensor_file(path))
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: {error}") from None


def _load_buffers(directory: str, run) -> None:
    """The saved persistent buffers (expert biases) into the model; a checkpoint without the
    file (written before buffers were saved) leaves them as initialized."""
    saved, expected = read_buffers_file(directory), model_buffers(run)
    if not saved:
        return
    if set(saved) != set(expected):
        raise CheckpointError(
            f"{directory}: saved buffers {sorted(saved)} are not this model's "
            f"{sorted(expected)}; load a checkpoint of the same architecture."
        )
    with torch.no_grad():
        for name, buf in expected.items():
            if saved[name].shape != buf.shape:
                raise CheckpointError(
                    f"{directory}: buffer {name} has shape {tuple(saved[name].shape)}, this "
                    f"model's is {tuple(buf.shape)}; load a checkpoint of the same architecture."
                )
            buf.copy_(saved[name])


def _load_model_tensors(directory: str, run, saved_flags: dict) -> None:
    named = read_model_file(directory)
    expected = run.optimizer.named_main_params()
    check_shapes(
        {name: tuple(t.shape) for name, t in named.items()},
        {name: tuple(t.shape) for name, t in expected.items()},
        source=os.path.join(directory, "model.pt"),
        saved_flags=saved_flags,
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
        set_rng_state(rng_state_from_plain(plain))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise CheckpointError(
            f"{rng_file}: not an RNG state ({type(error).__name__}: {error}); the file is "
            "corrupt. Load another iteration, or pass --no-load-rng."
        ) from None


def _load_scheduler(
    config: CheckpointConfig, metadata: dict, scheduler: OptimizerParamScheduler, directory: str
) -> None:
    """Restore the schedule's step count. As in Megatron-LM, a schedule whose flags differ from
    the checkpoint's (a longer --train-iters moves the decay) is refused unless the run says
    which one to use."""
    state = metadata.get("scheduler")
    try:
        differences = scheduler.config_differences(state)
        if config.override_opt_param_scheduler:
            differences = []
        if differences and not config.use_checkpoint_opt_param_scheduler:
            raise schedule_mismatch(differences, directory=directory)
        scheduler.load_state_dict(state, use_saved_config=config.use_checkpoint_opt_param_scheduler)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"{directory}/metadata.json: 'scheduler' is not a learning-rate schedule state "
            f"({type(error).__name__}: {error}); the file is corrupt or was edited. Load "
            "another iteration, or pass --no-load-optim to restart the schedule."
        ) from None


def load_checkpoint(
    config: CheckpointConfig,
    *,
    run: ModelAndOptimizer,
    scheduler: OptimizerParamScheduler,
    env: DistributedEnv,
) -> TrainState | None:
    """Restore from --load; returns the TrainState to continue from (None: nothing to load).

    pretrain has already run check_load_path (before building the model). Every other check
    that needs no tensor (tracker, metadata, saved flags and parameter shapes) runs before any
    file is read into the model or optimizer."""
    iteration = config.ckpt_step if config.ckpt_step is not None else read_tracker(config.load)
    if iteration is None:
        if env.rank == 0:
            print(f" > no checkpoint under --load {config.load}; training from scratch", flush=True)
        return None
    directory = resolve_iteration_dir(config.load, iteration)
    metadata = read_metadata(directory)
    check_saved_flags(metadata, config, directory=directory)
    check_saved_param_shapes(metadata, run, directory=directory)
    load_optim = not (config.no_load_optim or config.finetune)
    if config.ckpt_format in SHARDED_FORMATS:
        # --finetune loads weights only, in both formats: no delayed-scaling state either.
        saved_recipe = saved_run_flags(metadata).get("fp8_recipe")
        saved_delayed = names_delayed_scaling(saved_recipe) and not config.finetune
        _load_sharded(
            directory, run=run, env=env, load_optim=load_optim, fp8_scaling_state=saved_delayed
        )
    # Every rank reads these files on its own (its RNG file is its alone): a bad file on one
    # rank must stop all of them together, not leave the others in the first collective.
    failure: CheckpointError | None = None
    try:
        if config.ckpt_format not in SHARDED_FORMATS:
            _load_model_tensors(directory, run, saved_run_flags(metadata))
            if load_optim:
                _load_optimizer_file(directory, run)
        _load_buffers(directory, run)  # model state, as the weights (also with --finetune)
        if not config.finetune:
            _load_delayed_scaling_state(directory, run)
        if not (config.no_load_rng or config.finetune):
            _load_rng_state(directory, env)
    except CheckpointError as error:
        failure = error
    _raise_if_any_rank_failed(env, failure)
    if env.rank == 0:
        print(f" > loaded checkpoint {directory} (iteration {iteration})", flush=True)
    if config.finetune:
        return TrainState()
    if load_optim:
        _load_scheduler(config, metadata, scheduler, directory)
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
    if env.all_ranks_group is None:
        if failure is not None:
            raise failure
        return
    if first_failing_rank(env, failure) < 0:
        return
    messages: list[str | None] = [None] * env.world_size
    dist.all_gather_object(
        messages, None if failure is None else str(failure), group=env.all_ranks_group
    )
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise CheckpointError(message if rank == env.rank else f"(on rank {rank}) {message}")


def _load_sharded(directory: str, *, run, env, load_optim: bool, fp8_scaling_state: bool) -> None:
    # Ask for the delayed-scaling state only when the checkpoint has it (a bf16 or other-recipe
    # checkpoint can resume under delayed scaling, which then starts fresh).
    state = sharded_state(run, optimizer=load_optim, fp8_scaling_state=fp8_scaling_state)
    # Raises CheckpointError for a missing, truncated or mismatched shard or .metadata.
    dist_checkpointing.load(
        state, os.path.join(directory, "sharded"), process_group=env.all_ranks_group
    )
    try:
        load_sharded_state(run, state)
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{directory}/sharded: {error}") from None
