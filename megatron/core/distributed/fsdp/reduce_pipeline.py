"""The grad-reduce pipeline: average each unit's grads over DP ranks once its backward is done.

Gradient averaging: every reduced tensor is scaled by 1/W before a SUM collective (mean over
ranks; pre-scaling keeps bf16 reductions in range), so that W ranks with B samples each match
one process with W*B samples. W is the whole DP size, also under HSDP, where the inner
reduction is followed by a plain SUM over the outer group.

HSDP (an outer group of N replicas): once a unit's grads are final for the step (the reduction
outside no_sync(), or finish_grad_sync()), its inner result, this rank's grad shard, is
reduced across the replicas: all-reduced (outer no_shard) or reduce-scattered so each replica
keeps the part its optimizer owns (outer optim). It is launched as soon as the unit's inner
reduction is stored, so with overlap_grad_reduce it runs under the remaining backward.

Accumulation over micro-batches, by strategy:
- optim_grads / optim_grads_params (sharded grads): every micro-batch's full grads are
  reduce-scattered and the result is added to this rank's grad shard. no_sync() cannot skip
  this: a rank does not keep full grads between micro-batches.
- no_shard / optim: grads accumulate locally in the full grad buffer; the reduction (all-reduce,
  or reduce-scatter into this rank's slice) runs once, for the backward outside no_sync() or in
  finish_grad_sync(). More grads after that reduction in the same step is an error.
With overlap_grad_reduce the collectives are asynchronous: launching one stores the results of
the older ones (MAX_IN_FLIGHT), finish_grad_sync() waits for the rest; results are applied in
launch order, so overlap on and off give bitwise equal grads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.buffer_group import BufferGroup, FsdpUnit
from megatron.core.distributed.fsdp.collectives import (
    CommStats,
    all_reduce_sum,
    reduce_scatter_flat,
)
from megatron.core.distributed.fsdp.shard_layout import outer_chunk_numel

MAX_IN_FLIGHT = 1
"""Reductions left running after a new one is launched (the newest overlaps the next unit's
backward; older ones are stored first, in launch order)."""


@dataclass(eq=False)
class _PendingReduce:
    group: BufferGroup
    work: dist.Work | None
    result: torch.Tensor | None
    """Where the reduction lands, to be stored; None: it lands in the grad buffer itself."""
    keep_alive: torch.Tensor | None
    then_outer: bool = False
    """Launch the outer (replica) reduction of this group's grad shard once stored."""


@dataclass(eq=False)
class _PendingOuter:
    group: BufferGroup
    work: dist.Work | None
    result: torch.Tensor | None
    """outer optim: this replica's part of the reduce-scatter; None: all-reduced in place."""
    keep_alive: torch.Tensor | None


class GradReducePipeline:
    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup,
        overlap: bool,
        stats: CommStats,
        outer_group: dist.ProcessGroup | None = None,
        outer_shards_optimizer: bool = False,
    ) -> None:
        self.process_group = process_group
        self.outer_group = outer_group
        self.outer_size = 1 if outer_group is None else dist.get_world_size(outer_group)
        self.outer_shards_optimizer = outer_shards_optimizer
        # Gradients average over every DP rank, inner and outer.
        self.world_size = dist.get_world_size(process_group) * self.outer_size
        self.overlap = overlap
        self.stats = stats
        self._pending: list[_PendingReduce] = []
        self._pending_outer: list[_PendingOuter] = []

    def _group_of(self, group: BufferGroup) -> dist.ProcessGroup:
        """The group a buffer group's grads are reduced over: its own (expert parameters:
        the expert-data-parallel group; they are still averaged over every DP rank, as each
        expert's grads already hold its EP ranks' tokens), else the shard group."""
        return group.process_group if group.process_group is not None else self.process_group

    @property
    def has_outer(self) -> bool:
        return self.outer_group is not None

    @torch.no_grad()
    def reduce_unit(self, unit: FsdpUnit, *, then_outer: bool = False) -> None:
        """The inner reduction of `unit`'s grads; then_outer: these are the step's final grads,
        so the replica reduction follows as soon as they are stored (HSDP only)."""
        for group in unit.groups:
            group.finalize_grad_target()
            if group.writes_grads_directly and group.shards_grads:
                continue  # one-rank layout: the grads already sit in the grad shard
            if group.shards_grads:
                self._reduce_scatter_staging(group, then_outer=then_outer)
            else:
                self._reduce_local_grads(group, then_outer=then_outer)

    @torch.no_grad()
    def reduce_unit_outer(self, unit: FsdpUnit) -> None:
        """The replica reduction of grads whose inner reductions were all launched earlier."""
        self._store_inner_reductions()
        for group in unit.groups:
            self._launch_outer(group)

    def _launch_outer(self, group: BufferGroup) -> None:
        grads = group.grad_shard()
        nbytes = grads.numel() * grads.element_size()
        if not self.outer_shards_optimizer:
            work = all_reduce_sum(grads, group=self.outer_group, async_op=self.overlap)
            self.stats.add("outer_all_reduce_bytes", nbytes)
            self._pending_outer.append(_PendingOuter(group, work, None, None))
            return
        chunk = outer_chunk_numel(grads.numel(), outer_size=self.outer_size)
        padded = torch.zeros(chunk * self.outer_size, dtype=grads.dtype, device=grads.device)
        padded[: grads.numel()].copy_(grads)
        result = torch.empty(chunk, dtype=grads.dtype, device=grads.device)
        work = reduce_scatter_flat(result, padded, group=self.outer_group, async_op=self.overlap)
        self.stats.add("outer_reduce_scatter_bytes", padded.numel() * padded.element_size())
        self._pending_outer.append(_PendingOuter(group, work, result, padded))

    def _reduce_scatter_staging(self, group: BufferGroup, *, then_outer: bool) -> None:
        staging = group.staging
        if staging is None:
            return
        group.staging = None
        in_place = group.takes_reduce_output_in_place()
        grads = group.ensure_grad_buffer(zero=not in_place)
        group.grads_accumulated = True
        staging.mul_(1.0 / self.world_size)
        if in_place:
            result = grads
        else:
            result = torch.empty(
                group.layout.shard_numel, dtype=staging.dtype, device=staging.device
            )
        work = reduce_scatter_flat(
            result, staging, group=self._group_of(group), async_op=self.overlap
        )
        ran = group.layout.world_size > 1  # over one rank: a local copy, no collective
        self.stats.add("reduce_scatter_bytes", staging.numel() * staging.element_size() * ran)
        pending = _PendingReduce(
            group=group,
            work=work,
            result=None if in_place else result,
            keep_alive=staging,
            then_outer=then_outer,
        )
        self._queue(pending)

    def _reduce_local_grads(self, group: BufferGroup, *, then_outer: bool) -> None:
        grads = group.ensure_grad_buffer()
        if self.world_size == 1 and group.reduce_dtype == grads.dtype:
            return  # the mean over one rank is the grads themselves
        scaled = (grads * (1.0 / self.world_size)).to(group.reduce_dtype)
        nbytes = scaled.numel() * scaled.element_size()
        if group.layout.world_size == 1:  # no_shard: every rank keeps every grad
            work = all_reduce_sum(scaled, group=self._group_of(group), async_op=self.overlap)
            self.stats.add("all_reduce_bytes", nbytes if self.world_size > 1 else 0)
            self._queue(
                _PendingReduce(
                    group=group, work=work, result=scaled, keep_alive=None, then_outer=then_outer
                )
            )
            return
        result = torch.empty(group.layout.shard_numel, dtype=scaled.dtype, device=scaled.device)
        work = reduce_scatter_flat(
            result, scaled, group=self._group_of(group), async_op=self.overlap
        )
        self.stats.add("reduce_scatter_bytes", nbytes * (group.layout.world_size > 1))
        self._queue(
            _PendingReduce(
                group=group, work=work, result=result, keep_alive=scaled, then_outer=then_outer
            )
        )

    def _queue(self, pending: _PendingReduce) -> None:
        self._pending.append(pending)
        # Each pending reduction holds a unit's full-size grads (its input) and its output
        # until stored: keep at most MAX_IN_FLIGHT, so that memory stays at one or two units'
        # worth instead of growing with the model over the backward (as FSDP2 waits for the
        # previous unit's reduce-scatter in the next unit's post-backward).
        limit = MAX_IN_FLIGHT if self.overlap else 0
        while len(self._pending) > limit:
            self._store(self._pending.pop(0))

    @torch.no_grad()
    def _store(self, pending: _PendingReduce) -> None:
        if pending.work is not None:
            pending.work.wait()
        group = pending.group
        if pending.result is None:
            pass  # reduced straight into the grad shard
        elif group.shards_grads:
            group.grad_buffer.add_(pending.result)
        elif group.layout.world_size == 1:
            group.grad_buffer.copy_(pending.result)
        else:
            lo, hi = group.layout.shard_range(group.layout.rank)
            group.grad_buffer[lo:hi].copy_(pending.result)
        if pending.then_outer:
            self._launch_outer(group)

    @torch.no_grad()
    def _store_outer(self, pending: _PendingOuter) -> None:
        if pending.work is not None:
            pending.work.wait()
        if pending.result is not None:
            lo, hi = pending.group.optimizer_range
            pending.group.grad_shard()[lo:hi].copy_(pending.result[: hi - lo])

    def _store_inner_reductions(self) -> None:
        while self._pending:
            self._store(self._pending.pop(0))

    @torch.no_grad()
    def wait_all(self) -> None:
        """Wait for every launched reduction and store its result, in launch order."""
        self._store_inner_reductions()
        while self._pending_outer:
            self._store_outer(self._pending_outer.pop(0))
