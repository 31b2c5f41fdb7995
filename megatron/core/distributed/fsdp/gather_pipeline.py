"""The all-gather pipeline: gather a unit's compute params before use, prefetch the next ones.

With overlap_param_gather, the gathers of the next units (in the order they will run) are
launched asynchronously while the current unit computes, up to
suggested_communication_unit_size elements in flight (at least one unit, so that overlap always
happens). Without it, every gather is synchronous and issued when the unit is about to run.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.core.distributed.fsdp.buffer_group import FsdpUnit
from megatron.core.distributed.fsdp.collectives import CommStats
from megatron.core.distributed.fsdp.storage import GatherRole


class AllGatherPipeline:
    def __init__(self, *, overlap: bool, max_inflight_numel: int | None, stats: CommStats) -> None:
        self.overlap = overlap
        self.max_inflight_numel = max_inflight_numel
        self.stats = stats
        self._in_flight: dict[int, tuple[FsdpUnit, GatherRole, list[dist.Work]]] = {}

    def _start(self, unit: FsdpUnit, role: GatherRole, *, async_op: bool) -> list[dist.Work]:
        works = []
        for group in unit.groups:
            work, nbytes = group.storage.start_gather(role=role, async_op=async_op)
            self.stats.add("all_gather_bytes", nbytes)
            if group.storage.gather_stats_key is not None:
                self.stats.add(group.storage.gather_stats_key, nbytes)
            if work is not None:
                works.append(work)
        return works

    def _finish(self, unit: FsdpUnit, role: GatherRole, works: list[dist.Work]) -> None:
        for work in works:
            work.wait()
        for group in unit.groups:
            group.storage.finish_gather(role)

    def ensure_gathered(self, unit: FsdpUnit, role: GatherRole) -> None:
        """Block until `unit`'s params for `role` are gathered (waiting for a prefetch)."""
        pending = self._in_flight.pop(id(unit), None)
        if pending is not None:
            self._finish(unit, pending[1], pending[2])
            return
        if all(group.storage.is_gathered(role) for group in unit.groups):
            return
        self._finish(unit, role, self._start(unit, role, async_op=False))

    def prefetch(self, upcoming: list[FsdpUnit], role: GatherRole) -> None:
        """Launch async gathers of the next units to run, within the in-flight budget."""
        if not self.overlap:
            return
        inflight = sum(unit.numel() for unit, _, _ in self._in_flight.values())
        for index, unit in enumerate(upcoming):
            if id(unit) in self._in_flight:
                continue
            if all(group.storage.is_gathered(role) for group in unit.groups):
                continue
            over_budget = (
                self.max_inflight_numel is not None
                and inflight + unit.numel() > self.max_inflight_numel
            )
            if over_budget and (index > 0 or self._in_flight):
                break
            self._in_flight[id(unit)] = (unit, role, self._start(unit, role, async_op=True))
            inflight += unit.numel()
            if self.max_inflight_numel is None:
                break  # Default: one unit ahead.

    def release(self, unit: FsdpUnit) -> None:
        pending = self._in_flight.pop(id(unit), None)
        if pending is not None:
            self._finish(unit, pending[1], pending[2])
        for group in unit.groups:
            group.storage.release()

    def drain(self) -> None:
        for unit, role, works in list(self._in_flight.values()):
            self._finish(unit, role, works)
        self._in_flight.clear()
