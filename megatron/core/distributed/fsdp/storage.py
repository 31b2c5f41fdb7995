"""Storage adapters: how one buffer group keeps its compute params and gathers them.

The hooks and pipelines never branch on dtype or FP8 recipe; they call this interface. A unit
owns one adapter per buffer group. There are two: `DenseComputeStorage` here (bf16/fp32: the
shard is the parameter values, the gathered buffer is what the model reads; under ZeRO-3 with a
compute dtype narrower than the main params it keeps no shard of its own and casts the main
shard at gather time, as FSDP2 does), and `fp8_storage.Fp8ComputeStorage`, which implements the
same methods with several gathered buffers: `role="forward"` gathers
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
    def new_param(self, slot_index: int, *, requires_grad: bool) -> nn.Parameter:
        """The parameter of one slot, not yet pointing at the buffers (bind_params does)."""

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

    def bind_main_shard(self, main_shard: torch.Tensor) -> None:
        """Called once the group's main shard exists; storages that gather from it keep it."""
        return None

    def optimizer_amax_targets(
        self, pieces: list
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Where the optimizer step may report amaxes of the updated main shard (FusedAdamW's
        amax_targets): a zeroed amax vector laid out as amax_to_reduce's, and the 0-d cell of
        the vector that each of `pieces` (this rank's pieces, in order) raises. Hand the vector
        back with use_optimizer_amaxes after the step. None: amaxes are measured here."""
        return None

    def use_optimizer_amaxes(self, amaxes: torch.Tensor) -> None:
        """The next amax_to_reduce returns `amaxes` (the step's) instead of measuring them."""
        raise NotImplementedError(f"{type(self).__name__} takes no amaxes from the optimizer")

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


def _holds_exactly(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every `narrow` value is exactly representable in `wide` (fp32 holds bf16 and fp16)."""
    wide_info, narrow_info = torch.finfo(wide), torch.finfo(narrow)
    return (
        wide != narrow
        and wide_info.eps <= narrow_info.eps
        and wide_info.max >= narrow_info.max
        # Smallest subnormals: fp32's 2**-149 covers bf16's 2**-133 and fp16's 2**-24.
        and wide_info.smallest_normal * wide_info.eps
        <= narrow_info.smallest_normal * narrow_info.eps
    )


class DenseComputeStorage(ComputeStorage):
    """bf16/fp32 compute params. Gathered buffer = parameter values; one buffer for both roles.

    ZeRO-3 with main params wider than the compute dtype (bf16 compute, fp32 main) keeps no
    persistent compute shard: each gather casts the main shard into a temporary input that lives
    only until the gather is finished. The values are those a persistent shard would hold (the
    same fp32 -> bf16 rounding, done later), and a rank saves one compute shard of memory.
    Over a group of one rank the cast writes the gathered buffer itself. Otherwise a rank that
    holds the whole unit (no_shard, or ZeRO-3 over one rank) keeps its compute values in the
    gathered buffer: nothing is gathered or freed.
    """

    def __init__(
        self,
        *,
        layout: UnitLayout,
        dtype: torch.dtype,
        main_dtype: torch.dtype,
        device: torch.device,
        sharded: bool,
        group: dist.ProcessGroup,
        tracker: MemoryTracker,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.sharded = sharded
        self.group = group
        self.tracker = tracker
        # Only when main holds every compute value exactly: then casting the main shard at
        # gather time gives the bytes an initialized-then-written-back compute shard would.
        self.casts_main_shard = sharded and _holds_exactly(main_dtype, dtype)
        self._main_shard: torch.Tensor | None = None
        self._gather_input: torch.Tensor | None = None
        """The cast main shard of a gather in flight (kept alive until finish_gather)."""
        self.resident = not self.casts_main_shard and (not sharded or layout.world_size == 1)
        self.full_buffer = tracker.zeros(layout.padded_numel, dtype=dtype, device=device)
        lo, hi = layout.shard_range(layout.rank)
        if self.casts_main_shard:
            self.local_shard = None
            tracker.resize_storage(self.full_buffer, 0)
            self._gathered = False
        elif not self.resident:
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

    def new_param(self, slot_index: int, *, requires_grad: bool) -> nn.Parameter:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return nn.Parameter(empty, requires_grad=requires_grad)

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

    def _shard_to_gather(self) -> torch.Tensor:
        if not self.casts_main_shard:
            return self.local_shard
        if self._main_shard is None:
            raise RuntimeError("DenseComputeStorage: bind_main_shard() was never called")
        if self.layout.world_size == 1:
            return self._main_shard  # one rank: the gather's own copy casts it in place
        gather_input = self.tracker.empty(
            self._main_shard.shape, dtype=self.dtype, device=self.device
        )
        with torch.no_grad():
            gather_input.copy_(self._main_shard)
        return gather_input

    def start_gather(self, *, role: GatherRole, async_op: bool) -> tuple[dist.Work | None, int]:
        if self._gathered:
            return None, 0
        self.tracker.resize_storage(self.full_buffer, self._full_nbytes())
        shard = self._shard_to_gather()
        with torch.no_grad():
            work = all_gather_flat(self.full_buffer, shard, group=self.group, async_op=async_op)
        if self.casts_main_shard and work is not None:
            self._gather_input = shard  # an async gather still reads it
        self._gathered = True
        return work, self._full_nbytes() if self.layout.world_size > 1 else 0

    def finish_gather(self, role: GatherRole) -> None:
        self._gather_input = None

    def release(self) -> None:
        if not self.resident and self._gathered:
            self.tracker.resize_storage(self.full_buffer, 0)
            self._gathered = False

    def main_shard_alias(self, main_dtype: torch.dtype) -> torch.Tensor | None:
        return self.local_shard if self.dtype == main_dtype else None

    def bind_main_shard(self, main_shard: torch.Tensor) -> None:
        if self.casts_main_shard:
            self._main_shard = main_shard

    @torch.no_grad()
    def write_main_shard(
        self,
        main_shard: torch.Tensor,
        *,
        reduced_amax: torch.Tensor | None = None,
        update_scaling: bool = True,
    ) -> None:
        # Without a compute shard the next gather casts the updated main shard itself.
        if self.local_shard is not None and main_shard.data_ptr() != self.local_shard.data_ptr():
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
        if self.casts_main_shard:
            return  # the buffer fills the main shard; gathers read the value from there
        for piece in self.layout.pieces():
            if piece.slot is slot:
                src = flat[piece.param_start : piece.param_start + piece.numel]
                self.local_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(src)

    def stored_bytes(self) -> int:
        if self.casts_main_shard:
            return 0  # only a gather's transient input, counted by the tracker's peak
        shard_bytes = self.layout.shard_numel * self.full_buffer.element_size()
        return shard_bytes if self.sharded else self._full_nbytes()
