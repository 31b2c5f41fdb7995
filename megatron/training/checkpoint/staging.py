"""The host copy an --async-save writes from, in buffers reused by every save.

Each state entry (this rank's sharded model and optimizer state, the FP8 scaling state) is
copied into a host buffer of its own, allocated at the first save and reused by every later
one; a buffer is re-allocated only when its entry's shape or dtype changes, and `release` frees
them all when training ends. The run makes the next copy only after the previous write finished
(AsyncCheckpointSaver.stage checks), so a buffer is never overwritten while it is being written.

On CUDA the buffers are pinned and the device-to-host copies are queued, without blocking the
host, on a side stream that first waits for the work already queued on the current stream (so
it copies the values as of the save's iteration); an event recorded after the last copy is then
waited on twice:
- by the current stream before the next optimizer step (`before_optimizer_step`, a wait on the
  GPU, not on the host), the first thing after a save that writes params or optimizer state,
  so the forward and backward of the next iteration overlap the copy;
- by the writer thread (`copied.synchronize()`) before it hands the copies to
  torch.distributed.checkpoint.
Without CUDA the copies are plain synchronous copies into the same reused buffers.
Pinned buffers come from torch's caching host allocator, which rounds each block up to a power
of two: the host copy holds between 1x and 2x the state's bytes of page-locked memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.flat_dtensor import (
    flat_dtensor_runs,
    local_piece,
    piece_runs,
)


class HostStaging:
    """Host buffers keyed by each state entry's path, plus (on CUDA) the copy stream and the
    event of the last copy."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        # Page-locked memory comes from the CUDA runtime, so it needs CUDA even for CPU runs.
        self.pin_memory = torch.cuda.is_available()
        self.buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.copied: torch.cuda.Event | None = None
        self._optimizer_must_wait = False

    @torch.no_grad()
    def stage(self, state: Any, *, name: str, cpu_mesh: DeviceMesh | None) -> Any:
        """`state` with every tensor replaced by its host buffer (DTensor pieces keep their
        offsets, on `cpu_mesh`); on CUDA the copies may still be in flight (`copied`)."""
        if self.copy_stream is None:
            return self._stage(state, path=(name,), cpu_mesh=cpu_mesh)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            staged = self._stage(state, path=(name,), cpu_mesh=cpu_mesh)
        self.copied = torch.cuda.Event()
        self.copied.record(self.copy_stream)
        self._optimizer_must_wait = True
        return staged

    def before_optimizer_step(self) -> None:
        """Make the current stream wait for the copies of the last save (once per save)."""
        if self._optimizer_must_wait:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self._optimizer_must_wait = False

    def release(self) -> None:
        """Drop every buffer (training is over); the next `stage` allocates them again."""
        self.buffers.clear()
        self._optimizer_must_wait = False
        if self.pin_memory and hasattr(torch._C, "_host_emptyCache"):
            # torch keeps freed pinned blocks cached for reuse; hand them back to the system.
            torch._C._host_emptyCache()

    def _stage(self, state: Any, *, path: tuple[str, ...], cpu_mesh: DeviceMesh | None) -> Any:
        if isinstance(state, dict):
            return {
                key: self._stage(value, path=(*path, str(key)), cpu_mesh=cpu_mesh)
                for key, value in state.items()
            }
        if isinstance(state, DTensor):
            piece = self._copy(local_piece(state), path=path)
            return flat_dtensor_runs(
                piece, piece_runs(state), global_numel=state.shape[0], mesh=cpu_mesh
            )
        if isinstance(state, torch.Tensor):
            return self._copy(state, path=path)
        return state

    def _copy(self, source: torch.Tensor, *, path: tuple[str, ...]) -> torch.Tensor:
        source = source.detach()
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.pin_memory)
            self.buffers[path] = buffer
        buffer.copy_(source, non_blocking=self.copy_stream is not None)
        if source.is_cuda:
            # A source freed by its owner (the FP8 scaling state is a clone) must not be handed
            # to a new tensor of the current stream before the copy stream has read it.
            source.record_stream(self.copy_stream)
        return buffer
