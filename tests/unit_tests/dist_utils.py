"""Run a function on N gloo ranks in fresh processes, for multi-rank CPU tests.

The ranks are forked from multiprocessing's fork server, which imports torch and the FSDP engine
once per test session: a spawned rank spends 3-5 s of a 2-core machine importing them, a forked
one none. Each rank is still a new process (nothing a test does outlives it); it takes the
caller's environment, working directory and stdout/stderr at the call, as a spawned one would
(_Caller)."""

from __future__ import annotations

import io
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.launch import free_port

PRELOADED_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "megatron.core.distributed.fsdp",
)
"""Imported once in the fork server (its children inherit them). None of them reads the
environment when imported, so a rank that sees the caller's environment sees it in full."""

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(list(PRELOADED_MODULES))


class _Caller:
    """What a spawned rank would take from its caller at the call and a forked one does not:
    the environment, the working directory, and stdout/stderr (under pytest, the capture of
    the running test; the fork server kept those of the test that started it)."""

    def __init__(self, environ: dict[str, str], cwd: str, streams: tuple) -> None:
        self.environ, self.cwd, self.streams = environ, cwd, streams

    @classmethod
    def now(cls) -> _Caller:
        return cls(dict(os.environ), os.getcwd(), (1, 2))

    def __reduce__(self):
        # Runs while Process.start pickles the rank: DupFd has the fork server hand each of
        # the caller's descriptors to the child.
        streams = tuple(reduction.DupFd(fd) for fd in self.streams)
        return (_Caller, (self.environ, self.cwd, streams))

    def adopt(self) -> None:
        """In the rank: take the caller's environment, directory and stdout/stderr."""
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, stream in zip((1, 2), self.streams):
            fd = stream.detach()
            os.dup2(fd, target)
            os.close(fd)


def _worker(
    rank: int, world_size: int, port: int, caller: _Caller, fn: Callable, args: tuple, queue
) -> None:
    caller.adopt()
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
    queue = _CONTEXT.Queue()
    port = free_port()
    caller = _Caller.now()
    procs = [
        _CONTEXT.Process(target=_worker, args=(rank, world_size, port, caller, fn, args, queue))
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
