"""Storage adapters: how one buffer group keeps its compute params and gathers them.

The hooks and pipelines never branch on dtype or FP8 recipe; they call this interface. A unit
owns one adapter per buffer group. Today there is `DenseComputeStorage` (bf16/fp32: the shard
is the parameter values, the gathered buffer is what the model reads). The FP8 adapter of the
next issue implements the same methods with several gathered buffers: `role="forward"` gathers
rowwise uint8 bytes (+ scales), `role="backward"` gathers columnwise bytes for MXFP8 or reuses
the rowwise bytes plus a local transpose for per-tensor/128x128 recipes; `param_alignment`
returns the block size so that blocks never straddle a parameter or shard edge; and
`write_main_shard` quantizes instead of casting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.collectives import all_gather_flat
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import UnitLayout

GatherRole = Literal["forward", "backward"]


class ComputeStorage(ABC):
    """Compute-param storage for one buffer group of one FSDP unit."""

    layout: UnitLayout
    sharded: bool
    """True under ZeRO-3: each rank keeps only its shard; the full buffer exists while gathered."""
    gather_stats_key: str | None = None
    """A comm_stats key that counts this storage's all-gather bytes on top of all_gather_bytes."""

    @abstractmethod
    def bind_params(self, params: list[nn.Parameter]) -> None:
        """Point each parameter's `.data` at its view of the gathered buffer (no copies)."""

    @abstractmethod
    def is_gathered(self, role: GatherRole) -> bool: ...

    @abstractmethod
    def start_gather(self, *, role: GatherRole, async_op: bool) -> tuple[dist.Work | None, int]:
        """Allocate the gathered buffer for `role` and launch its all-gather.

        Returns (work handle or None when done, bytes of the gathered output).
        """

    @abstractmethod
    def finish_gather(self, role: GatherRole) -> None:
        """Called after the gather's wait(): local post-processing (FP8: transpose cache)."""

    @abstractmethod
    def release(self) -> None:
        """Free the gathered buffers (ZeRO-3 only; a no-op when params are replicated)."""

    @abstractmethod
    def main_shard_alias(self, main_dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's compute shard, when it can double as the fp32 main shard (same dtype)."""

    def amax_to_reduce(self, main_shard: torch.Tensor) -> torch.Tensor | None:
        """Partial amaxes (fp32, 1-D) that must be all-reduced (MAX) over the DP group before
        write_main_shard; the buffer packs every group's vector into one collective per step.
        None: nothing to agree on (dense storage)."""
        return None

    @abstractmethod
    def write_main_shard(
        self,
        main_shard: torch.Tensor,
        *,
        reduced_amax: torch.Tensor | None = None,
        update_scaling: bool = True,
    ) -> None:
        """Store updated main params (cast or quantize) into this rank's compute shard.

        reduced_amax: amax_to_reduce() after the MAX all-reduce. update_scaling=False re-writes
        with the current delayed-scaling state (checkpoint load) instead of advancing it.
        """

    @abstractmethod
    def sync_replicas(self, *, async_op: bool) -> tuple[dist.Work | None, int]:
        """Non-ZeRO-3 after the step: all-gather each rank's updated shard into every replica."""

    @abstractmethod
    def load_param_(self, slot_index: int, full_value: torch.Tensor) -> None:
        """Copy the part of one full parameter this rank stores (meta-device init)."""

    @abstractmethod
    def stored_bytes(self) -> int:
        """Bytes held persistently (not counting a transiently gathered ZeRO-3 buffer)."""


class DenseComputeStorage(ComputeStorage):
    """bf16/fp32 compute params. Gathered buffer = parameter values; one buffer for both roles."""

    def __init__(
        self,
        *,
        layout: UnitLayout,
        dtype: torch.dtype,
        device: torch.device,
        sharded: bool,
        group: dist.ProcessGroup,
        tracker: MemoryTracker,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.sharded = sharded
        self.group = group
        self.tracker = tracker
        self.full_buffer = tracker.zeros(layout.padded_numel, dtype=dtype, device=device)
        lo, hi = layout.shard_range(layout.rank)
        if sharded:
            self.local_shard = tracker.zeros(layout.shard_numel, dtype=dtype, device=device)
            # The full buffer object stays (parameters are views into it); its memory does not.
            tracker.resize_storage(self.full_buffer, 0)
            self._gathered = False
        else:
            self.local_shard = self.full_buffer[lo:hi]
            self._gathered = True

    @staticmethod
    def param_alignment(name: str, shape: torch.Size) -> int:
        # Dense values have no blocks, so parameters are packed without gaps.
        return 1

    def _full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full_buffer.element_size()

    def bind_params(self, params: list[nn.Parameter]) -> None:
        # Views need a storage big enough at creation; a released buffer is briefly re-sized
        # (never written, so never touched) and freed again.
        released = not self._gathered
        if released:
            self.tracker.resize_storage(self.full_buffer, self._full_nbytes())
        for slot, param in zip(self.layout.slots, params):
            view = self.full_buffer[slot.offset : slot.end].view(slot.shape)
            # `.data =` keeps the parameter's own autograd version counter, so collectives that
            # write the buffer do not invalidate tensors autograd saved from the parameter.
            param.data = view
        if released:
            self.tracker.resize_storage(self.full_buffer, 0)

    def is_gathered(self, role: GatherRole) -> bool:
        return self._gathered

    def start_gather(self, *, role: GatherRole, async_op: bool) -> tuple[dist.Work | None, int]:
        if self._gathered:
            return None, 0
        self.tracker.resize_storage(self.full_buffer, self._full_nbytes())
        work = all_gather_flat(
            self.full_buffer, self.local_shard, group=self.group, async_op=async_op
        )
        self._gathered = True
        return work, self._full_nbytes()

    def finish_gather(self, role: GatherRole) -> None:
        return None

    def release(self) -> None:
        if self.sharded and self._gathered:
            self.tracker.resize_storage(self.full_buffer, 0)
            self._gathered = False

    def main_shard_alias(self, main_dtype: torch.dtype) -> torch.Tensor | None:
        return self.local_shard if self.dtype == main_dtype else None

    @torch.no_grad()
    def write_main_shard(
        self,
        main_shard: torch.Tensor,
        *,
        reduced_amax: torch.Tensor | None = None,
        update_scaling: bool = True,
    ) -> None:
        if main_shard.data_ptr() != self.local_shard.data_ptr():
            self.local_shard.copy_(main_shard)

    def sync_replicas(self, *, async_op: bool) -> tuple[dist.Work | None, int]:
        if self.sharded or self.layout.world_size == 1:  # ZeRO-3, or no_shard (full replicas)
            return None, 0
        # A separate input: gloo does not document in-place all-gather (input inside output).
        # Kept on self until the next sync so that an async gather's input stays alive.
        self._sync_input = self.local_shard.clone()
        work = all_gather_flat(
            self.full_buffer, self._sync_input, group=self.group, async_op=async_op
        )
        return work, self._full_nbytes()

    @torch.no_grad()
    def load_param_(self, slot_index: int, full_value: torch.Tensor) -> None:
        slot = self.layout.slots[slot_index]
        flat = full_value.reshape(-1)
        if not self.sharded:
            self.full_buffer[slot.offset : slot.end].copy_(flat)
            return
        for piece in self.layout.pieces():
            if piece.slot is slot:
                src = flat[piece.param_start : piece.param_start + piece.numel]
                self.local_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(src)

    def stored_bytes(self) -> int:
        shard_bytes = self.layout.shard_numel * self.local_shard.element_size()
        return shard_bytes if self.sharded else self._full_nbytes()
