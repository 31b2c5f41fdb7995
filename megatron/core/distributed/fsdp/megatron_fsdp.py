"""Hooks and the per-unit state machine: gather before use, release after, reduce when done.

One training step under ZeRO-3 (optim_grads_params), for each micro-batch:
  root forward      gather the root unit (embedding, final norm, head); it stays gathered until
                    its grads are done, because the root runs first in forward and last in backward.
  unit pre-forward  wait for this unit's gather (prefetched), prefetch the next unit(s).
  unit post-forward release the gathered buffer; hook the unit's outputs for pre-backward.
  pre-backward      (first grad of the unit's outputs) gather again, prefetch the previous unit.
  grads done        (post-accumulate-grad hooks of all its params) stage the grads, reduce
                    (async with overlap_grad_reduce) and release the gathered buffer.
Other strategies keep compute params replicated, so only the grad half applies.

HSDP (groups.outer set): all of the above runs over the inner (shard) group; a unit's grads
are reduced across replicas once per step, after its final inner reduction (see
reduce_pipeline). Every micro-batch but the last must then run under no_sync(), for every
strategy: grads arriving after the replica reduction are an error, not a silent loss.

Activation recompute re-runs a unit's forward inside backward: those hooks see that backward is
running, keep the buffer gathered and neither prefetch nor re-register.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.dist_checkpointing.flat_dtensor import ExpertPlacement
from megatron.core.dist_checkpointing.tp_placement import TensorParallelPlacement
from megatron.core.distributed.data_parallel_mesh import DataParallelGroups
from megatron.core.distributed.fsdp.collectives import CommStats
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.gather_pipeline import AllGatherPipeline
from megatron.core.distributed.fsdp.param_and_grad_buffer import (
    BufferGroup,
    FsdpUnit,
    InitFn,
    ParamAndGradBuffer,
    find_unit_modules,
)
from megatron.core.distributed.fsdp.reduce_pipeline import GradReducePipeline
from megatron.core.fp8.engine_interface import QuantizedTensor


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) forward output that will receive a grad."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _grad_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _grad_tensors(item)]
    return []


class MegatronFSDP:
    """Owns the buffers, both pipelines and every hook for one wrapped model."""

    def __init__(
        self,
        module: nn.Module,
        *,
        config: FsdpConfig,
        groups: DataParallelGroups,
        device: torch.device,
        unit_types: tuple[type, ...],
        init_fn: InitFn | None,
        convert_fp8_linears: bool = False,
        expert_group: dist.ProcessGroup | None = None,
        expert_param_names: frozenset[str] = frozenset(),
        expert_placement: ExpertPlacement | None = None,
        tensor_parallel_placement: TensorParallelPlacement | None = None,
        tensor_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.expert_placement = expert_placement
        """Where the routed experts lie in the full expert tensors (checkpoints); None: no EP."""
        self.tensor_parallel_placement = tensor_parallel_placement
        """Where the TP shards lie in the full tensors (checkpoints); None: no TP."""
        self.groups = groups
        self.process_group: dist.ProcessGroup = groups.shard
        """The shard group: gathers, reduce-scatters, sharded checkpoints' pieces."""
        self.buffer = ParamAndGradBuffer(
            module,
            unit_modules=find_unit_modules(module, unit_types),
            config=config,
            group=groups.shard,
            device=device,
            init_fn=init_fn,
            convert_fp8_linears=convert_fp8_linears,
            outer_group=groups.outer,
            expert_group=expert_group,
            expert_param_names=expert_param_names,
            tensor_parallel_group=tensor_parallel_group,
        )
        self.stats = CommStats(outer=groups.outer is not None)
        self.gather = AllGatherPipeline(
            overlap=config.overlap_param_gather,
            max_inflight_numel=config.suggested_communication_unit_size,
            stats=self.stats,
        )
        self.reduce = GradReducePipeline(
            process_group=groups.shard,
            overlap=config.overlap_grad_reduce,
            stats=self.stats,
            outer_group=groups.outer,
            outer_shards_optimizer=config.outer_shards_optimizer,
        )
        self.hsdp = groups.outer is not None
        self.root = self.buffer.units[0]
        self.layer_units = self.buffer.units[1:]
        self.sync_enabled = True
        self._forward_order: list[FsdpUnit] = list(self.layer_units)
        self._current_order: list[FsdpUnit] = []
        self._grads_seen: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._locally_accumulated: set[int] = set()
        self._outer_pending: set[int] = set()
        """HSDP: units with inner reductions this step (under no_sync) and no replica one yet."""
        self._param_owner: dict[nn.Parameter, tuple[FsdpUnit, BufferGroup, int]] = {}
        self._install_hooks()

    # ----- hooks -------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        for unit in self.buffer.units:
            for group in unit.groups:
                for index, param in enumerate(group.params):
                    self._param_owner[param] = (unit, group, index)
                    if param.requires_grad:
                        param.register_post_accumulate_grad_hook(self._on_param_grad)
                    fuse = self.config.gradient_accumulation_fusion and param.requires_grad
                    if fuse and isinstance(param, QuantizedTensor):
                        param.main_grad_sink = self  # main_grad_slot / main_grad_written
        for unit in self.layer_units:
            unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
            unit.module.register_forward_hook(self._make_post_forward(unit))

    def _make_pre_forward(self, unit: FsdpUnit):
        def hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # activation recompute: the pre-backward hook already gathered
                self.gather.ensure_gathered(unit, "backward")
                # The recomputed forward reads the forward copy too (a no-op where one buffer
                # serves both roles; MXFP8 gathers its rowwise bytes as well).
                self.gather.ensure_gathered(unit, "forward")
                return
            self._current_order.append(unit)
            self.gather.ensure_gathered(unit, "forward")
            upcoming = self._forward_order
            position = upcoming.index(unit) if unit in upcoming else len(upcoming)
            self.gather.prefetch(upcoming[position + 1 :], "forward")

        return hook

    def _make_post_forward(self, unit: FsdpUnit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return
            if self.config.shards_params:
                self.gather.release(unit)
                tensors = _grad_tensors(output)
                if tensors and torch.is_grad_enabled():
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(unit), mode="any"
                    )

        return hook

    def _pre_backward(self, unit: FsdpUnit) -> None:
        self.gather.ensure_gathered(unit, "backward")
        order = self._forward_order
        if unit in order:
            position = order.index(unit)
            self.gather.prefetch(order[:position][::-1], "backward")

    def _on_param_grad(self, param: torch.Tensor) -> None:
        unit, group, index = self._param_owner[param]
        if param.grad is None:
            return
        self._check_not_reduced(unit)
        group.add_param_grad(index, param.grad)
        param.grad = None
        self._count_grad(unit)

    def _check_not_reduced(self, unit: FsdpUnit) -> None:
        if id(unit) in self._reduced:
            raise RuntimeError(
                f"Megatron-FSDP ({self._strategy_name()}): unit "
                f"{unit.name or '<root>'} got grads after its grads were already reduced this "
                "step; run every micro-batch but the last under model.no_sync()"
            )

    def _count_grad(self, unit: FsdpUnit) -> None:
        seen = self._grads_seen.get(id(unit), 0) + 1
        self._grads_seen[id(unit)] = seen
        if seen == sum(p.requires_grad for p in unit.params()):
            self._on_unit_grads_done(unit)

    def main_grad_slot(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Gradient accumulation fusion (the engine is each FP8 weight's main_grad_sink,
        fp8/main_grad.py): where `param`'s wgrad GEMM writes its micro-batch grad, and whether
        it adds to it."""
        unit, group, index = self._param_owner[param]
        self._check_not_reduced(unit)
        return group.grad_slot(index)

    def main_grad_written(self, param: torch.Tensor) -> None:
        """The wgrad GEMM wrote `param`'s grad into main_grad_slot's view: as after a grad hook."""
        unit, group, index = self._param_owner[param]
        group.slot_written(index)
        self._count_grad(unit)

    def _strategy_name(self) -> str:
        name = self.config.data_parallel_sharding_strategy
        if self.hsdp:
            name += f", HSDP outer {self.config.outer_dp_sharding_strategy}"
        return name

    def _on_unit_grads_done(self, unit: FsdpUnit) -> None:
        self._grads_seen[id(unit)] = 0
        shards_grads = self.config.shards_grads
        if shards_grads or self.sync_enabled:
            # Final grads of the step: no_shard/optim reduce only now; under HSDP every
            # strategy then reduces across replicas, which cannot take more grads after it.
            final = self.sync_enabled and (self.hsdp or not shards_grads)
            if final:
                self._reduced.add(id(unit))
                self._locally_accumulated.discard(id(unit))
                self._outer_pending.discard(id(unit))
            elif self.hsdp:
                self._outer_pending.add(id(unit))
            self.reduce.reduce_unit(unit, then_outer=final and self.hsdp)
        else:
            self._locally_accumulated.add(id(unit))
        if self.config.shards_params:
            self.gather.release(unit)

    # ----- entry points used by the adapter ----------------------------------------------

    def pre_root_forward(self) -> None:
        self._flush_partial_units()
        self._current_order = []
        self.gather.ensure_gathered(self.root, "forward")
        self.gather.prefetch(self._forward_order, "forward")

    def post_root_forward(self) -> None:
        if self._current_order:
            self._forward_order = self._current_order
        if self.config.shards_params and not torch.is_grad_enabled():
            self.gather.release(self.root)

    def _flush_partial_units(self) -> None:
        """Units where some params got no grad (unused this step): reduce what they have."""
        for unit in self.buffer.units:
            if self._grads_seen.get(id(unit), 0) > 0:
                self._on_unit_grads_done(unit)

    def finish_grad_sync(self) -> None:
        """Launch any reduction not yet launched, wait for all, and store the results."""
        self._flush_partial_units()
        for unit in self.buffer.units:
            if id(unit) in self._locally_accumulated:
                self._locally_accumulated.discard(id(unit))
                self._reduced.add(id(unit))
                self.reduce.reduce_unit(unit, then_outer=self.hsdp)
        for unit in self.buffer.units:
            if id(unit) in self._outer_pending:  # every micro-batch ran under no_sync()
                self._outer_pending.discard(id(unit))
                self._reduced.add(id(unit))
                self.reduce.reduce_unit_outer(unit)
        self.reduce.wait_all()
        self.gather.drain()

    def zero_grad_buffer(self) -> None:
        """Start a new step: zero grads, forget reductions, reset the byte counters."""
        self.reduce.wait_all()
        for group in self.buffer.all_groups():
            group.zero_grads()
        self._reduced.clear()
        self._locally_accumulated.clear()
        self._outer_pending.clear()
        self._grads_seen.clear()
        self.stats.reset()

    def units(self) -> Iterator[FsdpUnit]:
        yield from self.buffer.units
