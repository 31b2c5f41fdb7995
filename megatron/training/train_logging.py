"""What the training loop logs: the console lines on rank 0 (log_line.py formats them) and the
TensorBoard/W&B points (loggers.py), at Megatron-LM's intervals."""

from __future__ import annotations

import contextlib
import math

import torch

from megatron.core.optimizer import state_bytes_by_dtype
from megatron.training import fp8_stats
from megatron.training.flags.run_config import LoggingConfig, TrainingRunConfig
from megatron.training.initialize import DistributedEnv
from megatron.training.log_line import IntervalStats, format_train_line, format_valid_line
from megatron.training.loggers import MetricsLogger
from megatron.training.model_setup import ModelAndOptimizer
from megatron.training.moe_training import expert_load_scalars, interval_moe_fields
from megatron.training.run_hooks import memory_bytes
from megatron.training.train_state import TrainState


def print_rank_0(env: DistributedEnv, message: str) -> None:
    if env.rank == 0:
        print(message, flush=True)


def log_validation(
    env: DistributedEnv, *, state: TrainState, logger: MetricsLogger | None, valid_loss: float
) -> None:
    print_rank_0(env, format_valid_line(state.iteration, valid_loss))
    if logger is not None:
        logger.log_scalars(
            state.iteration,
            {
                "lm loss validation": valid_loss,
                "lm loss validation ppl": math.exp(min(20.0, valid_loss)),
            },
            samples=state.consumed_train_samples,
        )


def log_interval(
    config: TrainingRunConfig,
    *,
    env: DistributedEnv,
    run: ModelAndOptimizer,
    state: TrainState,
    stats: IntervalStats,
    lr: float,
    logger,
) -> None:
    seconds = stats.mean_seconds()
    tokens_per_gpu = (
        config.training.global_batch_size * config.training.seq_length / seconds / env.world_size
    )
    tflops = run.flops_per_iteration / seconds / env.world_size / 1e12
    mem, max_mem = memory_bytes(env.device)
    # A collective under Megatron-FSDP: every rank computes it.
    params_norm = run.optimizer.params_norm() if config.logging.log_params_norm else None
    per_layer = config.logging.moe_per_layer_logging
    moe_fields, moe_layers = interval_moe_fields(run, env, per_layer=per_layer)  # collectives
    expert_load = expert_load_scalars(run, env)
    print_rank_0(
        env,
        format_train_line(
            iteration=state.iteration,
            train_iters=config.training.train_iters,
            consumed_samples=state.consumed_train_samples,
            iteration_ms=seconds * 1000.0,
            tflops_per_gpu=tflops,
            tokens_per_gpu=tokens_per_gpu,
            learning_rate=lr,
            global_batch_size=config.training.global_batch_size,
            loss=stats.mean_loss(),
            grad_norm=stats.last_grad_norm,
            skipped=stats.skipped,
            nans=stats.nans,
            mem_gib=mem / 2**30,
            loss_scale=run.grad_scaler.scale if run.grad_scaler is not None else None,
            num_zeros=run.last_step.get("num-zeros")
            if config.logging.log_num_zeros_in_grad
            else None,
            params_norm=params_norm,
            extra_losses=stats.mean_extra_losses(),
            extra_fields=moe_fields,
        ),
    )
    if logger is not None:
        # Interval statistics; the per-iteration series go out in log_iteration.
        logger.log_scalars(
            state.iteration,
            {
                "iteration-time": seconds,
                "throughput/tflops-per-gpu": tflops,
                "throughput/tokens-per-sec-per-gpu": tokens_per_gpu,
                "mem-allocated-bytes": float(mem),
                "mem-max-allocated-bytes": float(max_mem),
                "skipped-iterations": float(stats.skipped),
                "nan-iterations": float(stats.nans),
                **moe_fields,
                **moe_layers,
                **expert_load,
            },
        )


def log_step_extras(
    config: LoggingConfig, *, run: ModelAndOptimizer, state: TrainState, logger
) -> None:
    """The Megatron-LM logging switches: step timers, params norm, zero-grad count, loss
    scale (TensorBoard/W&B, every --tensorboard-log-interval)."""
    if logger is None or state.iteration % config.tensorboard_log_interval != 0:
        return
    scalars = {}
    if config.log_timers_to_tensorboard:
        for name in ("forward-backward-time", "optimizer-time"):
            if name in run.last_step:
                scalars[name] = run.last_step[name]
    if config.log_params_norm:
        scalars["params-norm"] = run.optimizer.params_norm()
    if config.log_num_zeros_in_grad and run.last_step.get("num-zeros") is not None:
        scalars["num-zeros"] = float(run.last_step["num-zeros"])
    if run.grad_scaler is not None:
        scalars["loss-scale"] = run.grad_scaler.scale
    if scalars:
        logger.log_scalars(state.iteration, scalars, samples=state.consumed_train_samples)


def log_iteration(
    config: TrainingRunConfig,
    *,
    state: TrainState,
    logger,
    loss: float,
    grad_norm: float,
    lr: float,
    updated: bool,
) -> None:
    """Megatron-LM's per-iteration TensorBoard/W&B points, every --tensorboard-log-interval:
    this iteration's loss and grad norm (none for a skipped iteration, as Megatron-LM logs no
    loss for it), learning rate and batch size, each also against consumed samples."""
    if logger is None or state.iteration % config.logging.tensorboard_log_interval != 0:
        return
    scalars = {"learning-rate": lr, "batch-size": float(config.training.global_batch_size)}
    if updated:
        scalars["lm loss"], scalars["grad-norm"] = loss, grad_norm
    logger.log_scalars(state.iteration, scalars, samples=state.consumed_train_samples)


def held_bytes(run: ModelAndOptimizer) -> dict[str, int]:
    """Bytes this rank holds per part, from the engine's own buffers: params (compute
    storage), main_params (where they are not the params), grads, and the optimizer states by
    dtype ("optimizer states <dtype>")."""
    memory_bytes = getattr(run.model, "memory_bytes", None)
    if memory_bytes is not None:  # Megatron-FSDP: its buffers, padding included
        held = dict(memory_bytes())
    else:
        params = [p for p in run.module.parameters() if p.requires_grad]
        mains = getattr(run.optimizer, "main_params", [])
        model_ids = {id(p) for p in params}
        held = {
            "params": sum(_local_bytes(p) for p in params),
            "main_params": sum(_local_bytes(m) for m in mains if id(m) not in model_ids),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        }
    inner = getattr(run.optimizer, "optimizer", None)
    for dtype, nbytes in sorted(state_bytes_by_dtype(inner).items()):
        held[f"optimizer states {dtype}"] = nbytes
    return held


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def log_first_step(
    env: DistributedEnv, *, run: ModelAndOptimizer, seconds: float, compiled: bool
) -> None:
    """After the run's first step (rank 0): its time (the compile's, when the layers are
    compiled), the device memory, and what each part holds."""
    what = "including torch.compile of the layers" if compiled else "eager"
    print_rank_0(env, f" > first iteration: {seconds:.2f} s ({what})")
    if env.device.type == "cuda":
        allocated = torch.cuda.memory_allocated(env.device) / 2**30
        reserved = torch.cuda.memory_reserved(env.device) / 2**30
        print_rank_0(
            env,
            f" > memory after the first step (GiB) | allocated: {allocated:.2f} | "
            f"reserved: {reserved:.2f}",
        )
    held = held_bytes(run)
    parts = " | ".join(f"{part}: {n / 2**20:.2f}" for part, n in held.items())
    print_rank_0(env, f" > memory held by rank 0 (MiB) | {parts}")
    if env.device.type == "cuda":
        print_rank_0(env, peak_split_line(torch.cuda.max_memory_allocated(env.device), held))


def peak_split_line(peak_bytes: int, held: dict[str, int]) -> str:
    """The first step's allocation peak split into what the parts above hold and the rest:
    activations saved for backward, temporaries and workspaces at that moment."""
    rest = max(peak_bytes - sum(held.values()), 0)
    return (
        f" > memory at the first step's peak (MiB) | peak: {peak_bytes / 2**20:.2f} | "
        f"params, grads and optimizer states: {sum(held.values()) / 2**20:.2f} | "
        f"activations and temporaries: {rest / 2**20:.2f}"
    )


def build_fp8_stats(
    config: LoggingConfig, run: ModelAndOptimizer
) -> fp8_stats.Fp8StatsCollector | None:
    """--log-fp8-stats: the collector of the model's Fp8Linears (None when off or not FP8)."""
    fp8 = run.config.fp8
    if not config.log_fp8_stats or fp8 is None:
        return None
    return fp8_stats.Fp8StatsCollector(
        run.module,
        interval=config.log_fp8_stats_interval,
        recipe=fp8.recipe,
        fp8_format=fp8.fp8_format,
    )


@contextlib.contextmanager
def fp8_stats_step(collector, *, env: DistributedEnv, iteration: int, logger):
    """Around train_step of `iteration` (1-based): on a statistics iteration the Fp8Linears
    collect their operands' statistics, logged after the step (one host copy)."""
    if collector is None or not collector.due(iteration):
        yield
        return
    collector.switch(True)
    try:
        # Compiled layers run eagerly for this step (their compiled graphs stay as they are).
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        collector.switch(False)
    stats = collector.read()
    for line in fp8_stats.log_lines(iteration, stats):
        print_rank_0(env, line)
    if logger is not None:
        logger.log_scalars(iteration, fp8_stats.scalars(stats))
