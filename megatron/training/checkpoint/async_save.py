"""--async-save: checkpoints written by a background thread while training goes on.

A save copies this rank's share (sharded model and optimizer state, RNG state) to host memory
at the save's iteration (into buffers reused by every save; on CUDA pinned, copied on a side
stream while training goes on: staging.py), then a thread waits for the copy and
writes it into `iter_XXXXXXX.tmp/` through torch.distributed.checkpoint on a gloo group of its
own (a collective of the writer must not interleave with the training loop's on the same
group). After each later iteration every rank asks whether all writers are done (one small
all-reduce, only while a save is in flight); when they are, `finish_save` runs as for a
synchronous save: the ranks agree on failures, rank 0 writes metadata.json, publishes the
directory and only then moves `latest_checkpointed_iteration.txt`. A crash before that leaves a
`.tmp` directory that no load reads and the tracker naming the previous checkpoint; the next
save of that iteration replaces it. The run waits for the write in flight before the next save
and before it exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.flat_dtensor import data_parallel_mesh
from megatron.training.checkpoint.save import finish_save
from megatron.training.checkpoint.staging import HostStaging
from megatron.training.flags.run_config import CheckpointConfig
from megatron.training.initialize import DistributedEnv

SaveFault = Callable[[str, int], None]
"""Fault injection for tests, passed in by the caller of `pretrain`: called by each rank's
writer thread as `fault(tmp_dir, iteration)` once its shards are written and before the RNG
files and metadata.json (a test can stop or kill a rank mid-save there)."""


@dataclass
class _PendingSave:
    iteration: int
    metadata: dict
    thread: threading.Thread
    failure: BaseException | None = None


class AsyncCheckpointSaver:
    """One asynchronous save in flight at a time, finished collectively (every rank calls
    `finalize` at the same points of the loop)."""

    def __init__(
        self, config: CheckpointConfig, env: DistributedEnv, *, fault: SaveFault | None = None
    ) -> None:
        self.config = config
        self.env = env
        self.fault = fault
        ranks = dist.get_process_group_ranks(env.all_ranks_group)
        # Collective over the default group: every rank builds its saver at the same point.
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self.cpu_mesh = data_parallel_mesh(self.group, torch.device("cpu"))
        self.pending: _PendingSave | None = None
        self.staging = HostStaging(device=env.device)

    def stage(self, state: Any, *, name: str) -> Any:
        """`state` copied into this rank's host buffers of entry `name` (the copy may still be
        in flight on CUDA: the writer and the next optimizer step wait for it)."""
        if self.pending is not None:
            raise RuntimeError("an asynchronous save still writes the host copy; finalize it first")
        return self.staging.stage(state, name=name, cpu_mesh=self.cpu_mesh)

    def before_optimizer_step(self) -> None:
        """The training loop calls this before every optimizer step: the step must not
        overwrite params or optimizer state that a save's copy has yet to read."""
        self.staging.before_optimizer_step()

    def close(self) -> None:
        """Free the host buffers when training ends."""
        self.staging.release()

    def start(self, *, iteration: int, metadata: dict, write: Callable) -> None:
        """Run `write(group)` in a thread once the last `stage`'s copy is complete; `metadata`
        goes into metadata.json when it is done."""
        if self.pending is not None:
            raise RuntimeError("an asynchronous save is still in flight; finalize it first")
        pending = _PendingSave(iteration=iteration, metadata=metadata, thread=None)
        copied = self.staging.copied

        def run() -> None:
            try:
                if copied is not None:
                    copied.synchronize()  # the host copy of every tensor is complete
                write(self.group)
            except BaseException as error:  # noqa: BLE001 - agreed on and raised by finalize
                pending.failure = error

        # A daemon: a run that stops on an error does not wait for a write nobody finalizes.
        pending.thread = threading.Thread(target=run, name="async-checkpoint", daemon=True)
        self.pending = pending
        pending.thread.start()

    def _all_done(self) -> bool:
        done = torch.tensor(
            [0.0 if self.pending.thread.is_alive() else 1.0], device=self.env.device
        )
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.env.all_ranks_group)
        return bool(done.item())

    def finalize(self, *, blocking: bool) -> str | None:
        """Publish the save in flight once every rank's write completed (wait for it when
        `blocking`); returns its directory, or None when nothing was published. Raises
        CheckpointSaveError, on every rank, when some rank's write failed."""
        if self.pending is None or not (blocking or self._all_done()):
            return None
        self.pending.thread.join()
        pending, self.pending = self.pending, None
        return finish_save(
            self.config,
            env=self.env,
            iteration=pending.iteration,
            metadata=pending.metadata,
            failure=pending.failure,
        )
