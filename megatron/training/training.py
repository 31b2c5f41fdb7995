"""The training loop: setup, train steps with gradient accumulation, eval, logging, saving.

Read top to bottom: `pretrain` builds everything from the flags (data before the model, so bad
data fails before any weight exists), then `train` runs `train_step` per iteration.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.optimizer import OptimizerParamScheduler
from megatron.training.checkpoint import check_load_path, load_checkpoint, save_checkpoint
from megatron.training.checkpoint.async_save import AsyncCheckpointSaver, SaveFault
from megatron.training.data import (
    Datasets,
    build_datasets,
    build_tokenizer_from_config,
    get_micro_batch,
)
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_run_config
from megatron.training.flags.run_config import LoggingConfig, TrainingConfig, TrainingRunConfig
from megatron.training.initialize import (
    DistributedEnv,
    initialize_distributed,
    set_random_seeds,
    shutdown_distributed,
)
from megatron.training.log_line import IntervalStats
from megatron.training.loggers import MetricsLogger
from megatron.training.model_setup import ModelAndOptimizer, setup_model_and_optimizer
from megatron.training.moe_training import after_grad_sync, set_aux_loss_scale
from megatron.training.mtp_training import prepare_mtp, step_mtp_losses
from megatron.training.run_hooks import (
    ExitSignal,
    ManualGC,
    MemoryHistory,
    Profiler,
    RunHooks,
    empty_cuda_cache,
    exit_reason,
    memory_bytes,
)
from megatron.training.train_logging import (
    build_fp8_stats,
    fp8_stats_step,
    log_first_step,
    log_interval,
    log_iteration,
    log_step_extras,
    log_validation,
    print_rank_0,
)
from megatron.training.train_state import TrainState

__all__ = ["TrainState", "TrainingResult", "pretrain", "train", "train_step", "evaluate"]


class DataError(RuntimeError):
    """The training data or tokenizer files given on the command line cannot be used: a missing
    or corrupt .bin/.idx, a bad split or blend. pretrain_gpt.py prints one `error:` line and
    exits with status 2."""


class NonFiniteTrainingError(RuntimeError):
    """--check-for-nan-in-loss-and-grad found a NaN/Inf loss or grad norm: the run stops.
    pretrain_gpt.py prints it as one `error:` line on every rank and exits with status 1."""


@dataclass
class TrainingResult:
    """Per-iteration numbers of one run, for tests and tools."""

    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    valid_losses: dict[int, float] = field(default_factory=dict)
    state: TrainState = field(default_factory=TrainState)


def pretrain(
    argv: Sequence[str] | None = None,
    *,
    destroy_process_group: bool = True,
    save_fault: SaveFault | None = None,
) -> TrainingResult:
    """Entry point of pretrain_gpt.py: parse flags, build data, model, optimizer; train.

    The flags become typed configs here, once (configs.build_run_config); nothing below takes
    the argparse Namespace.

    destroy_process_group=False leaves the process group this call created alive after the
    final barrier: for a caller that exits the process next without teardown (pretrain_gpt.py).
    `save_fault` is fault injection for tests (async_save.SaveFault).
    """
    config = build_run_config(parse_args(argv))
    if config.checkpoint.load is not None:
        # A --load that is a file, or iterations without a tracker, fail before anything is built.
        check_load_path(config.checkpoint.load, config.checkpoint.ckpt_step)
    env = initialize_distributed(config.distributed)
    try:
        result = _build_and_train(config, env, save_fault=save_fault)
    except BaseException:
        # A one-rank group (Megatron-FSDP in one process) has no peer to wait for: free it so
        # that a library caller can run again. With several ranks the others may still be in a
        # collective, so the group is left to the process's exit.
        if env.owns_process_group and env.world_size == 1 and dist.is_initialized():
            dist.destroy_process_group()
        raise
    shutdown_distributed(env, destroy=destroy_process_group)
    return result


def _build_and_train(
    config: TrainingRunConfig, env: DistributedEnv, *, save_fault: SaveFault | None = None
) -> TrainingResult:
    _configure_logging(env, level=config.logging.logging_level)
    for note in config.logging.notes:
        print_rank_0(env, f" > note: {note}")
    if config.training.deterministic_mode:
        # Restored at the end of the run: a library caller's process keeps its own setting.
        previous = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            return _build_and_train_seeded(config, env, save_fault=save_fault)
        finally:
            torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    return _build_and_train_seeded(config, env, save_fault=save_fault)


def _build_and_train_seeded(
    config: TrainingRunConfig, env: DistributedEnv, *, save_fault: SaveFault | None = None
) -> TrainingResult:
    set_random_seeds(config.training.seed)
    try:
        tokenizer = build_tokenizer_from_config(config.data.tokenizer)
        datasets = build_datasets(config.data, tokenizer=tokenizer)
    except (OSError, ValueError) as error:
        # The data and tokenizer checks name the file and the fix in their message.
        raise DataError(str(error)) from error
    model_config = config.model_config(vocab_size=tokenizer.vocab_size)
    run = setup_model_and_optimizer(config.model_setup, config=model_config, env=env)
    scheduler = OptimizerParamScheduler(run.optimizer, config=config.lr_schedule)
    state = TrainState()
    if config.checkpoint.load is not None:
        state = load_checkpoint(config.checkpoint, run=run, scheduler=scheduler, env=env) or state
    if state.iteration >= config.training.train_iters:
        print_rank_0(
            env,
            f" > nothing to train: the checkpoint is at iteration {state.iteration} of "
            f"--train-iters {config.training.train_iters}; pass a larger --train-iters (and "
            "--use-checkpoint-opt_param-scheduler to keep the saved schedule) to go on",
        )
    fp8 = model_config.fp8
    print_rank_0(
        env,
        f" > megatron-fp8 run: fp8-recipe={fp8.recipe if fp8 is not None else 'none'} "
        f"params-dtype={str(model_config.params_dtype).removeprefix('torch.')} "
        f"fp8-param-gather={fp8 is not None and fp8.fp8_param_gather} "
        f"use-megatron-fsdp={config.model_setup.use_megatron_fsdp} "
        f"data-parallel-size={env.data_parallel_size}"
        + (
            f" tensor-parallel-size={env.tensor_parallel_size} "
            f"sequence-parallel={env.tensor_parallel.sequence_parallel}"
            if env.tensor_parallel is not None
            else ""
        ),
    )
    instances = config.distributed.num_distributed_optimizer_instances
    if instances > 1:
        print_rank_0(
            env,
            f" > HSDP: {instances} replicas x {env.world_size // instances} sharding ranks "
            "(consecutive), "
            f"outer-dp-sharding-strategy={config.model_setup.fsdp.outer_dp_sharding_strategy}",
        )
    rank = "(tensor, pipeline) model parallel rank (0, 0)"  # Megatron-LM's: its TP/EP shard
    print_rank_0(env, f" > number of parameters on {rank}: {run.num_parameters}")
    logger = _build_metrics_logger(config.logging, env)
    try:
        result = train(
            config,
            env=env,
            run=run,
            scheduler=scheduler,
            datasets=datasets,
            state=state,
            logger=logger,
            save_fault=save_fault,
        )
    finally:
        if logger is not None:
            logger.close()
    allocated, peak = memory_bytes(env.device)
    # As Megatron-LM's memory report: what benchmarks compare (peak over the whole run).
    print_rank_0(
        env,
        f" > memory (GiB) | allocated: {allocated / 2**30:.2f} | max allocated: {peak / 2**30:.2f}",
    )
    return result


def _configure_logging(env: DistributedEnv, *, level: int | None = None) -> None:
    """Library progress (index building, data checks) goes through `logging`: show it on rank 0
    (every rank at --logging-level, as Megatron-LM)."""
    if level is None:
        level = logging.INFO if env.rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=" > %(name)s: %(message)s")
    logging.getLogger().setLevel(level)


def _build_metrics_logger(config: LoggingConfig, env: DistributedEnv) -> MetricsLogger | None:
    if not (config.tensorboard_dir or config.wandb_project):
        return None
    return MetricsLogger(
        tensorboard_dir=config.tensorboard_dir,
        wandb_project=config.wandb_project,
        wandb_exp_name=config.wandb_exp_name,
        wandb_save_dir=config.wandb_save_dir,
        run_config=config.run_config,
        enabled=env.rank == 0,
    )


def _mean_over_ranks(value: torch.Tensor, env: DistributedEnv) -> float:
    """The mean over the data-parallel replicas (tensor-parallel ranks agree already)."""
    value = value.detach().float().reshape(1).clone()
    if env.dp_group is not None:
        dist.all_reduce(value, group=env.dp_group)
        value /= env.data_parallel_size
    return value.item()


def forward_backward(
    run: ModelAndOptimizer,
    batch: dict[str, torch.Tensor],
    *,
    num_microbatches: int,
    worker_threads: bool = False,
    loss_scale: float = 1.0,
    tokens_per_rank: float | None = None,
) -> torch.Tensor:
    """One micro-batch: token-mean loss over the loss mask, backward of loss / micro-batches.

    With `tokens_per_rank` (--calculate-per-token-loss: the global batch's loss-mask tokens
    divided by the data-parallel size, which the grad averaging divides by again) backward
    runs on the micro-batch's loss sum / tokens_per_rank, so the step's grads are those of
    the mean over every token of the global batch; the micro-batch's loss sum comes back.
    `loss_scale` (--fp16) multiplies what backward sees.

    Backward runs on this thread unless `worker_threads` (--backward-worker-threads): with
    one GPU per process the autograd engine's device worker thread only adds a hand-off,
    which costs the Python backward of every FP8 layer a thread switch and its wake-up."""
    mask = batch["loss_mask"]
    mtp_inputs = prepare_mtp(run.model, mask, num_microbatches, loss_scale, tokens_per_rank)
    token_losses = run.model(
        batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"], **mtp_inputs
    )
    if tokens_per_rank is not None:
        loss = (token_losses.float() * mask).sum()
        objective = loss / tokens_per_rank
    else:
        loss = (token_losses * mask).sum() / mask.sum().clamp(min=1.0)
        objective = loss / num_microbatches
    with torch.autograd.set_multithreading_enabled(worker_threads):
        (objective * loss_scale if loss_scale != 1.0 else objective).backward()
    return loss.detach()


def seed_dropout(seed: int, *, first_sample: int, stream: int = 0) -> None:
    """Seed the generators dropout draws from by the micro-batch's first global sample.

    The micro-batches of a step are the same sample ranges at any data-parallel size (rank r's
    m-th micro-batch at DP=N is the (m*N + r)-th at DP=1), so their dropout masks, and the
    losses, do not depend on the DP size, and a resume at another DP size is exact. Activation
    recompute restores the state the forward started from (torch.utils.checkpoint).

    `stream` > 0 (the tensor-parallel rank under --sequence-parallel, where every dropout
    acts on this rank's sequence shard or attention heads) draws other masks per TP rank."""
    entropy = [seed, first_sample] + ([stream] if stream else [])
    mixed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
    torch.manual_seed(int(mixed) >> 1)  # manual_seed takes a non-negative 63-bit value


def _dropout_stream(env: DistributedEnv) -> int:
    """Without sequence parallelism the TP ranks share one stream: the hidden dropout acts on
    replicated activations and must draw the same mask on each."""
    tensor_parallel = env.tensor_parallel
    if tensor_parallel is None or not tensor_parallel.sequence_parallel:
        return 0
    return tensor_parallel.rank + 1


def _step_batches(
    config: TrainingConfig,
    *,
    env: DistributedEnv,
    dataset: torch.utils.data.Dataset,
    state: TrainState,
) -> tuple[list[dict[str, torch.Tensor]], float | None]:
    """This rank's micro-batches of the step, and with --calculate-per-token-loss the global
    batch's loss tokens per data-parallel rank (else None)."""
    step_samples = config.micro_batch_size * env.data_parallel_size
    batches = [
        get_micro_batch(
            dataset,
            first_sample=state.consumed_train_samples + microbatch * step_samples,
            micro_batch_size=config.micro_batch_size,
            rank=env.data_parallel_rank,
            device=env.device,
        )
        for microbatch in range(config.num_microbatches)
    ]
    if not config.calculate_per_token_loss:
        return batches, None
    # The whole global batch's loss tokens, known before any forward (as Megatron-LM
    # normalizes by them after the reduction).
    tokens = torch.stack([batch["loss_mask"].sum() for batch in batches]).sum().float()
    global_tokens = _mean_over_ranks(tokens, env) * env.data_parallel_size
    return batches, max(global_tokens, 1.0) / env.data_parallel_size


def train_step(
    config: TrainingConfig,
    *,
    env: DistributedEnv,
    run: ModelAndOptimizer,
    dataset: torch.utils.data.Dataset,
    state: TrainState,
    saver: AsyncCheckpointSaver | None = None,
) -> tuple[float, float, bool]:
    """One optimizer step over the global batch. Returns (loss, grad norm, update succeeded);
    run.last_step gets the forward-backward and optimizer seconds and the zero-grad count."""
    step_start = time.time()
    run.optimizer.zero_grad()
    step_samples = config.micro_batch_size * env.data_parallel_size
    batches, tokens_per_rank = _step_batches(config, env=env, dataset=dataset, state=state)
    scaler = run.grad_scaler
    set_aux_loss_scale(
        run,
        loss_scale=scaler.scale if scaler is not None else 1.0,
        num_microbatches=config.num_microbatches,
        tokens_per_rank=tokens_per_rank,
        microbatch_tokens=batches[0]["tokens"].numel(),
        device=env.device,
    )
    losses = []
    for microbatch, batch in enumerate(batches):
        is_last = microbatch == config.num_microbatches - 1
        seed_dropout(
            config.seed,
            first_sample=state.consumed_train_samples
            + microbatch * step_samples
            + env.data_parallel_rank * config.micro_batch_size,
            stream=_dropout_stream(env),
        )
        with contextlib.nullcontext() if is_last else run.no_sync():
            losses.append(
                forward_backward(
                    run,
                    batch,
                    num_microbatches=config.num_microbatches,
                    worker_threads=config.backward_worker_threads,
                    loss_scale=scaler.scale if scaler is not None else 1.0,
                    tokens_per_rank=tokens_per_rank,
                )
            )
    run.finish_grad_sync()
    after_grad_sync(run, env)
    empty_cuda_cache(config.empty_unused_memory_level, level=1, device=env.device)
    optimizer_start = time.time()
    run.optimizer.loss_scale = scaler.scale if scaler is not None else 1.0
    if saver is not None:  # issue 21: a save's copy may still be reading params and moments
        saver.before_optimizer_step()
    result = run.optimizer.step()
    if scaler is not None:
        scaler.update(found_inf=not result.update_successful)
    empty_cuda_cache(config.empty_unused_memory_level, level=2, device=env.device)
    if tokens_per_rank is not None:
        loss = _mean_over_ranks(torch.stack(losses).sum(), env) / tokens_per_rank
    else:
        loss = _mean_over_ranks(torch.stack(losses).mean(), env)
    run.last_step = {
        "mtp-losses": {
            name: _mean_over_ranks(torch.tensor(value, device=env.device), env)
            for name, value in step_mtp_losses(run.model).items()
        },
        "forward-backward-time": optimizer_start - step_start,
        "optimizer-time": time.time() - optimizer_start,
        "num-zeros": result.num_zeros_in_grad,
    }
    return loss, result.grad_norm, result.update_successful


@torch.no_grad()
def evaluate(
    config: TrainingConfig,
    *,
    env: DistributedEnv,
    run: ModelAndOptimizer,
    dataset: torch.utils.data.Dataset,
) -> float:
    """Mean loss over the first --eval-iters global batches of the split (the same every time)."""
    run.model.eval()
    step_samples = config.micro_batch_size * env.data_parallel_size
    losses = []
    for index in range(config.eval_iters * config.num_microbatches):
        batch = get_micro_batch(
            dataset,
            first_sample=index * step_samples,
            micro_batch_size=config.micro_batch_size,
            rank=env.data_parallel_rank,
            device=env.device,
        )
        token_losses = run.model(
            batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"]
        )
        mask = batch["loss_mask"]
        losses.append((token_losses * mask).sum() / mask.sum().clamp(min=1.0))
    run.model.train()
    return _mean_over_ranks(torch.stack(losses).mean(), env)


def train(
    config: TrainingRunConfig,
    *,
    env: DistributedEnv,
    run: ModelAndOptimizer,
    scheduler: OptimizerParamScheduler,
    datasets: Datasets,
    state: TrainState,
    logger: MetricsLogger | None = None,
    save_fault: SaveFault | None = None,
) -> TrainingResult:
    saver = None
    if config.checkpoint.async_save and config.checkpoint.save:
        saver = AsyncCheckpointSaver(config.checkpoint, env, fault=save_fault)
    hooks = RunHooks(
        profiler=Profiler(config.hooks, rank=env.rank, device=env.device),
        memory=MemoryHistory(config.hooks, rank=env.rank, device=env.device),
        gc=ManualGC(config.hooks),
    )
    try:
        with ExitSignal(config.training.exit_signal_handler) as exit_signal:
            result = _train_loop(
                config,
                env=env,
                run=run,
                scheduler=scheduler,
                datasets=datasets,
                state=state,
                logger=logger,
                exit_signal=exit_signal,
                hooks=hooks,
                saver=saver,
            )
            if saver is not None:
                saver.finalize(blocking=True)  # a run ends only once its last save is published
            return result
    finally:
        hooks.close()
        if saver is not None:  # issue 21: free the pinned host copy
            saver.close()


def _train_loop(
    config: TrainingRunConfig,
    *,
    env: DistributedEnv,
    run: ModelAndOptimizer,
    scheduler: OptimizerParamScheduler,
    datasets: Datasets,
    state: TrainState,
    logger: MetricsLogger | None,
    exit_signal: ExitSignal,
    hooks: RunHooks,
    saver: AsyncCheckpointSaver | None = None,
) -> TrainingResult:
    training, logging_config, checkpoint = config.training, config.logging, config.checkpoint
    result = TrainingResult(state=state)
    stats = IntervalStats()
    start = time.time()
    run.model.train()
    first_iteration = state.iteration + 1
    fp8_stats = build_fp8_stats(logging_config, run)
    while state.iteration < training.train_iters:
        hooks.profiler.before_iteration(state.iteration)
        step_start = time.time()
        with fp8_stats_step(fp8_stats, env=env, iteration=state.iteration + 1, logger=logger):
            loss, grad_norm, ok = train_step(
                training, env=env, run=run, dataset=datasets.train, state=state, saver=saver
            )
        _check_finite(training, run=run, iteration=state.iteration + 1, loss=loss, norm=grad_norm)
        if ok:
            scheduler.step()
        lr = scheduler.get_lr()  # after the step, as Megatron-LM logs it: the next update's
        _count_step(training, state=state, result=result, loss=loss, grad_norm=grad_norm, ok=ok)
        stats.add(
            loss=loss,
            grad_norm=grad_norm,
            seconds=time.time() - step_start,
            skipped=not ok,
            extra_losses=run.last_step.get("mtp-losses"),
        )
        if state.iteration == first_iteration:
            compiled = config.model_setup.torch_compile
            log_first_step(env, run=run, seconds=time.time() - step_start, compiled=compiled)
        log_iteration(
            config, state=state, logger=logger, loss=loss, grad_norm=grad_norm, lr=lr, updated=ok
        )
        log_step_extras(logging_config, run=run, state=state, logger=logger)
        hooks.profiler.after_iteration(state.iteration)
        hooks.gc.after_iteration(state.iteration)
        if state.iteration % logging_config.log_interval == 0:
            log_interval(config, env=env, run=run, state=state, stats=stats, lr=lr, logger=logger)
            hooks.memory.dump()
            stats = IntervalStats()
        if _evaluation_due(training, valid=datasets.valid, iteration=state.iteration):
            hooks.gc.around_evaluation()
            valid_loss = evaluate(training, env=env, run=run, dataset=datasets.valid)
            hooks.gc.around_evaluation()
            result.valid_losses[state.iteration] = valid_loss
            log_validation(env, state=state, logger=logger, valid_loss=valid_loss)
        if saver is not None:
            saver.finalize(blocking=False)  # publishes a save in flight once all ranks wrote it
        exiting = exit_reason(
            training, env=env, start=start, iteration=state.iteration, exit_signal=exit_signal
        )
        if checkpoint.save and (
            exiting
            or state.iteration == training.train_iters
            or (checkpoint.save_interval and state.iteration % checkpoint.save_interval == 0)
        ):
            save_checkpoint(
                checkpoint, run=run, scheduler=scheduler, state=state, env=env, async_saver=saver
            )
        if exiting:
            print_rank_0(env, f" > exiting at iteration {state.iteration} ({exiting})")
            break
    return result


def _count_step(
    training: TrainingConfig,
    *,
    state: TrainState,
    result: TrainingResult,
    loss: float,
    grad_norm: float,
    ok: bool,
) -> None:
    """The step's counters (Megatron's: a skipped step counts as NaN when its loss is not
    finite), consumed samples, and its loss and grad norm in the result."""
    if not ok:
        state.skipped_iterations += 1
        state.nan_iterations += int(not math.isfinite(loss))
    state.iteration += 1
    state.consumed_train_samples += training.global_batch_size
    result.losses[state.iteration] = loss
    result.grad_norms[state.iteration] = grad_norm


def _check_finite(
    training: TrainingConfig, *, run: ModelAndOptimizer, iteration: int, loss: float, norm: float
) -> None:
    """--check-for-nan-in-loss-and-grad: stop at a NaN/Inf loss or grad norm. Under fp16 loss
    scaling an Inf grad norm is an overflow: the scaler skips that update and lowers the scale
    (Megatron-LM), so only the loss stops the run."""
    grad_checked = math.isfinite(norm) or run.grad_scaler is not None
    if training.check_for_nan_in_loss_and_grad and not (math.isfinite(loss) and grad_checked):
        # Every rank sees the same reduced loss and global grad norm, so all stop here
        # together; the update was not applied and nothing of this state is saved.
        raise NonFiniteTrainingError(
            f"iteration {iteration}: lm loss {loss} and grad norm {norm}; "
            "the run stops before saving (--check-for-nan-in-loss-and-grad is on by "
            "default; lower --lr or check the data, resume with --load from the last "
            "checkpoint, or pass --no-check-for-nan-in-loss-and-grad to skip such updates)"
        )


def _evaluation_due(
    training: TrainingConfig, *, valid: torch.utils.data.Dataset | None, iteration: int
) -> bool:
    """Every --eval-interval iterations and after the last one, when there is a valid split."""
    if valid is None or training.eval_iters <= 0:
        return False
    return iteration % training.eval_interval == 0 or iteration == training.train_iters
