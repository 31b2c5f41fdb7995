"""One FSDP unit's buffer groups: `BufferGroup` (one storage kind of one unit: layout, compute
storage, main shard and grads, and how a micro-batch's grads reach the grad buffer) and
`FsdpUnit`. `param_and_grad_buffer.ParamAndGradBuffer` builds them; param_and_grad_buffer.py's
docstring says which buffer each sharding strategy keeps whole or sharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.grad_copy import write_grad_
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import LocalPiece, UnitLayout, clip_pieces
from megatron.core.distributed.fsdp.storage import ComputeStorage


@dataclass(eq=False)
class BufferGroup:
    """One storage kind of one unit: layout, compute storage, main shard and grads."""

    names: list[str]
    params: list[nn.Parameter]
    layout: UnitLayout
    storage: ComputeStorage
    main_shard: torch.Tensor
    main_is_alias: bool
    grad_dtype: torch.dtype
    reduce_dtype: torch.dtype
    shards_grads: bool
    device: torch.device
    tracker: MemoryTracker
    grad_buffer: torch.Tensor | None = None
    """Sharded-grad strategies: this rank's reduced grad shard. Otherwise: the full local grads."""
    staging: torch.Tensor | None = None
    """Sharded-grad strategies: the full grads of the current micro-batch, until reduced."""
    grads_accumulated: bool = False
    """Whether any grad reached grad_buffer since the last zero_grads()."""
    written_slots: set[int] = field(default_factory=set)
    """Slots of the grad target (staging, or grad_buffer where grads are written directly)
    that a grad has written since the target was allocated."""
    target_needs_zeroing: bool = False
    """The grad target was allocated without zeros, and what no grad wrote (padding, params
    without a grad) has not been zeroed yet: finalize_grad_target() does it."""
    optimizer_range: tuple[int, int] | None = None
    """[lo, hi) of the shard whose optimizer state this rank holds (outer optim); None: all."""
    outer_replicas: int = 1
    """Replicas of this shard across the outer (HSDP) group; grads then need the outer
    reduction, so they always go through the reduce pipeline."""
    process_group: dist.ProcessGroup | None = None
    """Expert parameters (expert parallelism): the expert-data-parallel group this group is
    sharded and reduced over; None: the engine's shard group (every DP rank)."""

    @property
    def writes_grads_directly(self) -> bool:
        """Grads go straight into grad_buffer: every strategy but the sharded-grad ones, and
        those too on a one-rank layout in the grad dtype, where the reduce-scatter would only
        copy the staging buffer into the grad shard (DP=1: saves a zero fill, a scaling pass
        by 1.0 and that copy, 16 bytes per fp32 grad element per micro-batch)."""
        if not self.shards_grads:
            return True
        return (
            self.process_group is None  # expert grads are averaged over every DP rank
            and self.layout.world_size == 1
            and self.outer_replicas == 1
            and self.reduce_dtype == self.grad_dtype
        )

    def pieces(self) -> list[LocalPiece]:
        return self.layout.pieces()

    def optimizer_pieces(self) -> list[LocalPiece]:
        """The pieces this rank's optimizer updates: all of its shard, or its outer part."""
        if self.optimizer_range is None:
            return self.pieces()
        return clip_pieces(self.pieces(), *self.optimizer_range)

    def ensure_grad_buffer(self, *, zero: bool = True) -> torch.Tensor:
        """The grad buffer, allocated on first use in a step: zeros, or (zero=False, for a
        caller that overwrites all of it) whatever the allocator hands back."""
        numel = self.layout.shard_numel if self.shards_grads else self.layout.padded_numel
        if self.grad_buffer is None:
            allocate = self.tracker.zeros if zero else self._empty_flat
            self.grad_buffer = allocate(numel, dtype=self.grad_dtype, device=self.device)
        elif self.grad_buffer.untyped_storage().nbytes() == 0:
            self.tracker.resize_storage(self.grad_buffer, numel * self.grad_buffer.element_size())
            if zero:
                self.grad_buffer.zero_()
        return self.grad_buffer

    def _empty_flat(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.tracker.empty(torch.Size([numel]), dtype=dtype, device=device)

    def takes_reduce_output_in_place(self) -> bool:
        """Whether the next reduce-scatter can write straight into the grad shard: nothing
        accumulated there yet this step and no dtype change (FSDP2 likewise makes the first
        reduce-scatter output the sharded grad). Saves a shard-size buffer and an add."""
        return (
            self.shards_grads
            and not self.grads_accumulated
            and self.reduce_dtype == self.grad_dtype
        )

    def grad_shard(self) -> torch.Tensor:
        """Grads of this rank's main shard (after the reduction of the step is complete)."""
        if self.writes_grads_directly:
            self.finalize_grad_target()
        grads = self.ensure_grad_buffer()
        if self.shards_grads:
            return grads
        lo, hi = self.layout.shard_range(self.layout.rank)
        return grads[lo:hi]

    @torch.no_grad()
    def add_param_grad(self, index: int, grad: torch.Tensor) -> None:
        """Put one parameter's micro-batch grad where the strategy accumulates it.

        The first grad of a slot in its target is copied, later ones added, so the target needs
        no zero fill up front: finalize_grad_target() zeroes only what no grad wrote (padding,
        params without a grad)."""
        target, accumulate = self.grad_slot(index)
        write_grad_(target, grad, accumulate=accumulate)
        self.slot_written(index)

    def grad_slot(self, index: int) -> tuple[torch.Tensor, bool]:
        """Where parameter `index`'s micro-batch grad goes (a 1-D view of its slot in staging,
        or in grad_buffer where grads are written directly) and whether it must be added to
        what is there; call slot_written(index) once the grad is in."""
        slot = self.layout.slots[index]
        if self.writes_grads_directly:
            target = self._grad_buffer_for_writing()
            self.grads_accumulated = True
        else:
            if self.staging is None:
                self.staging = self.tracker.empty(
                    torch.Size([self.layout.padded_numel]),
                    dtype=self.reduce_dtype,
                    device=self.device,
                )
                self.written_slots = set()
                self.target_needs_zeroing = True
            target = self.staging
        return target[slot.offset : slot.end], index in self.written_slots

    def slot_written(self, index: int) -> None:
        self.written_slots.add(index)

    def _grad_buffer_for_writing(self) -> torch.Tensor:
        """grad_buffer for direct grad writes, allocated without zeros by the step's first
        grad."""
        if self.grad_buffer is None or self.grad_buffer.untyped_storage().nbytes() == 0:
            self.ensure_grad_buffer(zero=False)
            self.written_slots = set()
            self.target_needs_zeroing = True
        return self.grad_buffer

    @torch.no_grad()
    def finalize_grad_target(self) -> None:
        """Zero what no grad wrote in the grad target (the gaps between written slots, and the
        padding), so that a reduction or the optimizer reads zeros there. Idempotent."""
        if not self.target_needs_zeroing:
            return
        target = self.grad_buffer if self.writes_grads_directly else self.staging
        start = 0
        for index, slot in sorted(enumerate(self.layout.slots), key=lambda item: item[1].offset):
            if index in self.written_slots:
                if slot.offset > start:
                    target[start : slot.offset].zero_()
                start = max(start, slot.end)
        if target.numel() > start:
            target[start:].zero_()
        self.written_slots = set(range(len(self.layout.slots)))
        self.target_needs_zeroing = False

    def zero_grads(self) -> None:
        """A new step: the grad memory is given back until the step's first grad arrives (as
        FSDP2 frees its grads), so the forward pass, where activations peak, never holds it."""
        if self.grad_buffer is not None:
            self.tracker.resize_storage(self.grad_buffer, 0)
        self.staging = None
        self.written_slots = set()
        self.target_needs_zeroing = False
        self.grads_accumulated = False

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per role (padding included); a gathered buffer is transient."""
        main = 0 if self.main_is_alias else self.main_shard.numel() * self.main_shard.element_size()
        grads = (
            0
            if self.grad_buffer is None
            else self.grad_buffer.numel() * self.grad_buffer.element_size()
        )
        return {"params": self.storage.stored_bytes(), "main_params": main, "grads": grads}


@dataclass(eq=False)
class FsdpUnit:
    """A module whose params are gathered together, or the root (module is the wrapped model)."""

    name: str
    module: nn.Module
    groups: list[BufferGroup] = field(default_factory=list)
    is_root: bool = False

    def params(self) -> Iterator[nn.Parameter]:
        for group in self.groups:
            yield from group.params

    def numel(self) -> int:
        return sum(group.layout.padded_numel for group in self.groups)
