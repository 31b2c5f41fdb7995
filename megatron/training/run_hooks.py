"""What the training loop does around its steps for Megatron-LM's run flags: profiling
(--profile), memory snapshots (--record-memory-history), manual garbage collection
(--manual-gc), emptying the CUDA cache (--empty-unused-memory-level), fp16 loss scaling, when to
stop (--exit-interval, --exit-duration-in-mins, --exit-signal-handler), the memory report.
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.optimizer.grad_scaler import GradScaler
from megatron.training.flags.run_config import LossScaleConfig, RunHooksConfig, TrainingConfig
from megatron.training.initialize import DistributedEnv


def _profiles_rank(config: RunHooksConfig, rank: int) -> bool:
    return not config.profile_ranks or rank in config.profile_ranks  # [] is every rank


def torch_profile_dir(tensorboard_dir: str) -> str:
    """Megatron-LM's trace directory: torch_profile/ next to the TensorBoard directory."""
    return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile")


class Profiler:
    """--profile: iterations profile_step_start .. profile_step_end - 1 (1-based, as the log
    counts them) are profiled. With --use-pytorch-profiler a torch.profiler schedule (wait
    start - 1, warmup 1, active end - start, as Megatron-LM) records them and the trace goes to
    torch_profile/rank-R.json.gz; the k-th iteration is ProfilerStep#k. Without it, on CUDA,
    cudaProfilerStart/Stop bound an Nsight capture range (after iteration start until after
    iteration end, as Megatron-LM)."""

    def __init__(self, config: RunHooksConfig, *, rank: int, device: torch.device) -> None:
        self.enabled = config.profile and _profiles_rank(config, rank)
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.rank = rank
        self.torch_profiler = None
        pytorch_profiler = config.use_pytorch_profiler
        self.cuda_range = self.enabled and not pytorch_profiler and device.type == "cuda"
        if self.enabled and pytorch_profiler:
            self.trace_dir = torch_profile_dir(config.tensorboard_dir)
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(self.start - 1, 0),
                    warmup=1 if self.start > 0 else 0,
                    active=self.end - self.start,
                    repeat=1,
                ),
                on_trace_ready=self._write_trace,
            )
            self.torch_profiler.start()

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"rank-{self.rank}.json.gz")
        profiler.export_chrome_trace(path + ".tmp.json.gz")  # the suffix picks gzip
        os.replace(path + ".tmp.json.gz", path)

    def before_iteration(self, iteration: int) -> None:
        """`iteration`: iterations completed so far (the next one is iteration + 1)."""
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.cuda_range and iteration == self.start:
            # Megatron-LM opens the Nsight range once `start` iterations are done.
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after_iteration(self, iteration: int) -> None:
        """`iteration`: iterations completed, this one included."""
        if iteration == self.end:
            self.stop()

    def stop(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda_range:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.cuda_range = False


class MemoryHistory:
    """--record-memory-history: the CUDA allocator records every allocation with its stack;
    a snapshot (for pytorch.org/memory_viz) is dumped at every log interval to
    --memory-snapshot-path with _RANK before the extension, as Megatron-LM names it. There is
    no CPU allocator history in torch, so on CPU this does nothing (the log says so)."""

    def __init__(self, config: RunHooksConfig, *, rank: int, device: torch.device) -> None:
        self.enabled = (
            config.record_memory_history and device.type == "cuda" and _profiles_rank(config, rank)
        )
        base, ext = os.path.splitext(config.memory_snapshot_path)
        self.path = f"{base}_{rank}{ext}"
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def dump(self) -> None:
        if not self.enabled:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.path + ".tmp")
        os.replace(self.path + ".tmp", self.path)

    def stop(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.enabled = False


class ManualGC:
    """--manual-gc: the automatic collector is off for the run; a full collection runs every
    --manual-gc-interval iterations and around each evaluation, at the same point on every
    rank (Megatron-LM: aligns the pauses across ranks)."""

    def __init__(self, config: RunHooksConfig) -> None:
        self.enabled = config.manual_gc
        self.interval = config.manual_gc_interval
        self._was_enabled = gc.isenabled()
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval > 0 and iteration % self.interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        if self.enabled:
            gc.collect()

    def close(self) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()


def empty_cuda_cache(setting: int, *, level: int, device: torch.device) -> None:
    """--empty-unused-memory-level `setting`: 1 after forward-backward, 2 also after the step."""
    if setting >= level and device.type == "cuda":
        torch.cuda.empty_cache()


def build_grad_scaler(config: LossScaleConfig | None) -> GradScaler | None:
    """--fp16: the static --loss-scale, or a dynamic scaler from the --*loss-scale* flags."""
    if config is None:
        return None
    if config.loss_scale is not None:
        return GradScaler(scale=config.loss_scale, dynamic=False)
    return GradScaler(
        scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_interval=int(config.loss_scale_window),
        hysteresis=config.hysteresis,
    )


@dataclass
class RunHooks:
    """The per-iteration side work of the run flags: profiler, memory history, manual GC."""

    profiler: Profiler
    memory: MemoryHistory
    gc: ManualGC

    def close(self) -> None:
        self.profiler.stop()
        self.memory.stop()
        self.gc.close()


class ExitSignal:
    """--exit-signal-handler: SIGTERM only sets a flag; the loop reads it between iterations
    (Megatron-LM's DistributedSignalHandler). Installed for the length of `with`, on the main
    thread only (Python delivers signals there)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> ExitSignal:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.enabled and self._previous is not None:  # None: set from C, not restorable
            signal.signal(signal.SIGTERM, self._previous)


def exit_reason(
    config: TrainingConfig,
    *,
    env: DistributedEnv,
    start: float,
    iteration: int,
    exit_signal: ExitSignal,
) -> str:
    """Why to stop after `iteration` ('' to go on). Time and signal are MAX-reduced over the
    ranks, so that every rank stops (and saves) at the same iteration."""
    if config.exit_interval is not None and iteration % config.exit_interval == 0:
        return f"--exit-interval {config.exit_interval}"
    if config.exit_duration_in_mins is None and not exit_signal.enabled:
        return ""
    flags = torch.tensor(
        [(time.time() - start) / 60.0, float(exit_signal.received)], device=env.device
    )
    if env.all_ranks_group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=env.all_ranks_group)
    minutes, received = flags.tolist()
    if exit_signal.enabled and received > 0:
        return "SIGTERM received"
    if config.exit_duration_in_mins is not None and minutes > config.exit_duration_in_mins:
        return f"--exit-duration-in-mins {config.exit_duration_in_mins}"
    return ""


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, peak allocated) bytes: CUDA allocator on GPU, process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * resource.getpagesize()
    # ru_maxrss is sampled by the kernel; never report a peak below the current value.
    return rss, max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
