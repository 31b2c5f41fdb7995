"""Counts the bytes of every tensor the FSDP engine allocates, live and at peak.

The engine allocates all of its buffers through one tracker so that tests (and the benchmark)
can assert how much memory a rank holds without relying on allocator statistics, which CPU
tensors do not have. Freed tensors are subtracted by a weakref finalizer; buffers whose storage
is resized to zero and back (ZeRO-3 gathered buffers) report their resizes explicitly.
"""

from __future__ import annotations

import weakref

import torch


class MemoryTracker:
    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _sub(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def zeros(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.zeros(numel, dtype=dtype, device=device)
        self.track(tensor)
        return tensor

    def empty(self, shape: torch.Size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        self.track(tensor)
        return tensor

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s current storage until it is garbage collected."""
        nbytes = tensor.untyped_storage().nbytes()
        self._add(nbytes)
        # Resizable buffers report resizes themselves; the finalizer subtracts what is left.
        state = {"nbytes": nbytes}
        tensor._fsdp_tracked_state = state  # noqa: SLF001 - read by resize_storage
        weakref.finalize(tensor, self._sub_state, state)

    def _sub_state(self, state: dict) -> None:
        self._sub(state["nbytes"])

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Resize `tensor`'s storage (to free or re-allocate a gathered buffer), counting it."""
        storage = tensor.untyped_storage()
        if storage.nbytes() == nbytes:
            return
        state = getattr(tensor, "_fsdp_tracked_state", None)
        if state is not None:
            self._sub(state["nbytes"])
            state["nbytes"] = nbytes
            self._add(nbytes)
        storage.resize_(nbytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
