"""Run a function on N gloo ranks in fresh processes, for multi-rank CPU tests."""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.launch import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # By value: a tensor sent through a torch.multiprocessing queue travels as a shared-memory
        # handle that the receiver opens from this process, which may have exited by then
        # (seen as FileNotFoundError in the parent on a loaded machine).
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list:
    """Call fn(rank, world_size, *args) on world_size gloo ranks; return results by rank.

    fn must be importable (module level). Any rank's exception fails the caller with that
    rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
            else:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [results[rank] for rank in range(world_size)]
