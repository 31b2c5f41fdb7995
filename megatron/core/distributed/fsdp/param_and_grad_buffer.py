"""Flat per-unit buffers: compute params, fp32 main params and grads, and their shard views.

Every FSDP unit (a TransformerLayer, or the root: everything outside the layers) owns one
`BufferGroup` per storage kind (today: one per parameter dtype; with FP8, quantized weights and
the bf16 rest). A group holds, per role, one flat buffer laid out by `shard_layout`:

| role           | no_shard | optim      | optim_grads | optim_grads_params |
|----------------|----------|------------|-------------|--------------------|
| compute params | full     | full       | full        | shard* (+ full while gathered) |
| main params    | full     | shard      | shard       | shard              |
| grads          | full     | full       | shard       | shard              |

FP8 weights (QuantizedTensor parameters, or Fp8Linear weights with fp8_param_gather) form their
own group per recipe, stored by `fp8_storage.Fp8ComputeStorage`; their main params are always
fp32 shards seeded with the exact high-precision init values.

When the compute dtype equals main_params_dtype the main params *are* the compute buffer's
shard (no second copy, as FSDP2 does for fp32 params). *With a narrower compute dtype (bf16
compute, fp32 main) ZeRO-3 keeps no compute shard at all: each all-gather casts the main shard
into a temporary input, as FSDP2 does. Grad buffers are allocated at the first
backward (or when the optimizer is built), so building a model never holds them, and given back
at every zero_grad_buffer() (re-allocated by the step's first grad), so no forward holds them.

no_shard uses a one-rank layout (no padding; the "shard" is the whole buffer); the other
strategies pad each group to a multiple of the DP size.

HSDP (an outer replica group): everything above is per replica, over the inner (shard) group.
With outer `optim` each replica's optimizer owns only `optimizer_range`, its 1/N part of the
shard; the fp32 main shard itself stays whole on every replica (FP8 bytes and bf16 compute
values are written from it, with amaxes agreed over the inner group only) and is refreshed by
an outer all-gather of the updated parts after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.collectives import CommStats, all_gather_flat
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.fp8_layout import plan_fp8_layout
from megatron.core.distributed.fsdp.fp8_storage import (
    Fp8ComputeStorage,
    Fp8ParamSpec,
    fp8_param_spec,
    materialize_delayed_scaling,
)
from megatron.core.distributed.fsdp.grad_copy import write_grad_
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import (
    LocalPiece,
    UnitLayout,
    build_unit_layout,
    clip_pieces,
    outer_chunk_numel,
    outer_shard_range,
)
from megatron.core.distributed.fsdp.storage import ComputeStorage, DenseComputeStorage
from megatron.core.fp8.param_init import (
    clear_high_precision_init_val,
    get_high_precision_init_val,
)
from megatron.core.fp8.quantized_tensor import QuantizedTensor

InitFn = Callable[[str, torch.Tensor], None]


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

    @property
    def writes_grads_directly(self) -> bool:
        """Grads go straight into grad_buffer: every strategy but the sharded-grad ones, and
        those too on a one-rank layout in the grad dtype, where the reduce-scatter would only
        copy the staging buffer into the grad shard (DP=1: saves a zero fill, a scaling pass
        by 1.0 and that copy, 16 bytes per fp32 grad element per micro-batch)."""
        if not self.shards_grads:
            return True
        return (
            self.layout.world_size == 1
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
        accumulate = index in self.written_slots
        write_grad_(target[slot.offset : slot.end], grad, accumulate=accumulate)
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


def find_unit_modules(
    module: nn.Module, unit_types: tuple[type, ...]
) -> list[tuple[str, nn.Module]]:
    """Outermost submodules of the given types, in registration (= forward) order."""
    found: list[tuple[str, nn.Module]] = []
    for name, submodule in module.named_modules():
        if not name or not isinstance(submodule, unit_types):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, submodule))
    return found


def _owner_unit(param_names: list[str], unit_names: list[str]) -> str:
    """The unit holding every use of a parameter; shared across units means the root ('')."""
    owners = set()
    for name in param_names:
        owners.add(next((u for u in unit_names if name.startswith(u + ".")), ""))
    return owners.pop() if len(owners) == 1 else ""


def _replace_parameter(module: nn.Module, names: list[str], new_param: nn.Parameter) -> None:
    """Install `new_param` under every name of a (possibly tied) parameter."""
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        setattr(owner, attr, new_param)


class ParamAndGradBuffer:
    """All units' buffer groups for one model; built once, before hooks are installed."""

    def __init__(
        self,
        module: nn.Module,
        *,
        unit_modules: list[tuple[str, nn.Module]],
        config: FsdpConfig,
        group: dist.ProcessGroup,
        device: torch.device,
        init_fn: InitFn | None,
        convert_fp8_linears: bool = False,
        outer_group: dist.ProcessGroup | None = None,
    ) -> None:
        """convert_fp8_linears: keep every Fp8Linear weight in FP8 (fp8_param_gather), even one
        built in high precision; QuantizedTensor parameters are kept in FP8 regardless.
        group: the shard group; outer_group: the replica group under HSDP (None otherwise)."""
        self.config = config
        self.convert_fp8_linears = convert_fp8_linears
        self.group = group
        self.outer_group = outer_group
        self.outer_size = 1 if outer_group is None else dist.get_world_size(outer_group)
        self.outer_rank = 0 if outer_group is None else dist.get_rank(outer_group)
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.tracker = MemoryTracker()
        materialize_delayed_scaling(module, device)
        all_names: dict[int, list[str]] = {}
        params_by_id: dict[int, nn.Parameter] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            all_names.setdefault(id(param), []).append(name)
            params_by_id[id(param)] = param
        unit_names = [name for name, _ in unit_modules]
        members: dict[str, list[int]] = {name: [] for name in ["", *unit_names]}
        for param_id, names in all_names.items():
            members[_owner_unit(names, unit_names)].append(param_id)
        self.units: list[FsdpUnit] = [FsdpUnit(name="", module=module, is_root=True)]
        self.units += [FsdpUnit(name=name, module=unit) for name, unit in unit_modules]
        self.param_names: dict[nn.Parameter, list[str]] = {}
        for unit in self.units:
            ids = members[unit.name]
            self._build_unit(module, unit, [(all_names[i], params_by_id[i]) for i in ids], init_fn)
        del params_by_id  # the original (FP8) parameters, replaced by buffer-backed ones
        # FP8 bytes exist only after quantizing the main params: one collective for all units.
        self.write_back_main_params(groups=self.fp8_groups())

    def _build_unit(
        self,
        module: nn.Module,
        unit: FsdpUnit,
        named: list[tuple[list[str], nn.Parameter]],
        init_fn: InitFn | None,
    ) -> None:
        buckets: dict[object, list[tuple[list[str], nn.Parameter, Fp8ParamSpec | None]]] = {}
        for names, param in named:
            spec = fp8_param_spec(
                module, names[0], param, convert_fp8_linears=self.convert_fp8_linears
            )
            key = param.dtype if spec is None else spec.group_key
            buckets.setdefault(key, []).append((names, param, spec))
        for key, entries in buckets.items():
            members = [(names, param) for names, param, _ in entries]
            if entries[0][2] is None:
                group = self._build_group(key, members, init_fn)
            else:
                group = self._build_fp8_group(entries, init_fn)
            unit.groups.append(group)
            for (names, _), new_param in zip(members, group.params):
                _replace_parameter(module, names, new_param)
                self.param_names[new_param] = names

    def _build_group(
        self,
        dtype: torch.dtype,
        members: list[tuple[list[str], nn.Parameter]],
        init_fn: InitFn | None,
    ) -> BufferGroup:
        config = self.config
        shards = config.shards_optimizer_state
        layout = build_unit_layout(
            [(names[0], param.shape) for names, param in members],
            world_size=self.world_size if shards else 1,
            rank=self.rank if shards else 0,
            param_alignment=DenseComputeStorage.param_alignment,
        )
        storage = DenseComputeStorage(
            layout=layout,
            dtype=dtype,
            main_dtype=config.main_params_dtype,
            device=self.device,
            sharded=config.shards_params,
            group=self.group,
            tracker=self.tracker,
        )
        alias = storage.main_shard_alias(config.main_params_dtype)
        group = self._new_group(members, layout, storage, main_shard=alias)
        storage.bind_main_shard(group.main_shard)
        for index, (names, param) in enumerate(members):
            self._materialize_param(group, index, names[0], param, init_fn)
        group.params = [
            nn.Parameter(
                torch.empty(0, dtype=dtype, device=self.device), requires_grad=p.requires_grad
            )
            for _, p in members
        ]
        storage.bind_params(group.params)
        return group

    def _new_group(
        self,
        members: list,
        layout: UnitLayout,
        storage: ComputeStorage,
        *,
        main_shard: torch.Tensor | None,
    ) -> BufferGroup:
        """A group whose main params alias `main_shard`, or a fresh zero main shard if None."""
        config = self.config
        main_is_alias = main_shard is not None
        if main_shard is None:
            main_shard = self.tracker.zeros(
                layout.shard_numel, dtype=config.main_params_dtype, device=self.device
            )
        reduce_dtype = torch.bfloat16 if config.grad_reduce_in_bf16 else config.main_grads_dtype
        optimizer_range = None
        if config.outer_shards_optimizer and self.outer_size > 1:
            optimizer_range = outer_shard_range(
                layout.shard_numel, outer_size=self.outer_size, outer_rank=self.outer_rank
            )
        return BufferGroup(
            names=[member[0][0] for member in members],
            params=[],
            layout=layout,
            storage=storage,
            main_shard=main_shard,
            main_is_alias=main_is_alias,
            grad_dtype=config.main_grads_dtype,
            reduce_dtype=reduce_dtype,
            shards_grads=config.shards_grads,
            device=self.device,
            tracker=self.tracker,
            optimizer_range=optimizer_range,
            outer_replicas=self.outer_size,
        )

    def _build_fp8_group(
        self,
        entries: list[tuple[list[str], nn.Parameter, Fp8ParamSpec]],
        init_fn: InitFn | None,
    ) -> BufferGroup:
        config = self.config
        if config.main_params_dtype != torch.float32:
            raise ValueError(
                "Megatron-FSDP with FP8 parameters needs fp32 main params (the exact values FP8 "
                f"is re-quantized from); got --main-params-dtype {config.main_params_dtype}"
            )
        shards = config.shards_optimizer_state
        spec = entries[0][2]
        layout, scales_sharded = plan_fp8_layout(
            [(names[0], param.shape) for names, param, _ in entries],
            recipe=spec.recipe,
            world_size=self.world_size if shards else 1,
            rank=self.rank if shards else 0,
        )
        storage = Fp8ComputeStorage(
            layout=layout,
            scales_sharded=scales_sharded,
            spec=spec,
            delayed_metas=[entry_spec.delayed_meta for _, _, entry_spec in entries],
            device=self.device,
            sharded=config.shards_params,
            group=self.group,
            tracker=self.tracker,
        )
        group = self._new_group(entries, layout, storage, main_shard=None)
        storage.bind_main_shard(group.main_shard)  # aligned mxfp8 quantizes from it at gathers
        for index, (names, param, _) in enumerate(entries):
            full_value = self._fp8_init_value(names[0], param, init_fn)
            self._copy_to_main(group, index, full_value)
            clear_high_precision_init_val(param)
        group.params = [
            storage.new_param(index, requires_grad=param.requires_grad)
            for index, (_, param, _) in enumerate(entries)
        ]
        storage.bind_params(group.params)
        return group

    @torch.no_grad()
    def _fp8_init_value(self, name: str, param: torch.Tensor, init_fn: InitFn | None):
        """The exact high-precision value of an FP8 weight: init_fn on meta, else the value
        quantized_model_init kept, else the high-precision weight itself. Only a QuantizedTensor
        built without a kept value falls back to its (lossy) dequantized bytes."""
        if param.is_meta:
            if init_fn is None:
                raise ValueError(
                    f"FSDP: FP8 parameter {name!r} is on the meta device but no init_fn was "
                    "given; pass init_fn=lambda name, t: init_parameter_(t, name=name, ...)"
                )
            # Drawn in the weight's own dtype, as a non-meta build holds it (init rounds its
            # fp32 draw into the tensor), so meta init starts from the same bf16 values.
            full_value = self.tracker.empty(param.shape, dtype=param.dtype, device=self.device)
            init_fn(name, full_value)
            return full_value.to(torch.float32)
        kept = get_high_precision_init_val(param)
        if kept is not None:
            return kept.to(self.device, torch.float32)
        if isinstance(param, QuantizedTensor):
            return param.dequantize(torch.float32).to(self.device)
        return param.detach().to(self.device, torch.float32)

    @torch.no_grad()
    def _copy_to_main(self, group: BufferGroup, index: int, full_value: torch.Tensor) -> None:
        flat = full_value.reshape(-1)
        for piece in group.layout.pieces():
            if piece.slot is group.layout.slots[index]:
                src = flat[piece.param_start : piece.param_start + piece.numel]
                group.main_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(src)

    @torch.no_grad()
    def _materialize_param(
        self,
        group: BufferGroup,
        index: int,
        name: str,
        param: nn.Parameter,
        init_fn: InitFn | None,
    ) -> None:
        """Fill this rank's part of one parameter, holding at most that one full tensor."""
        if param.is_meta:
            if init_fn is None:
                raise ValueError(
                    f"FSDP: parameter {name!r} is on the meta device but no init_fn was given; "
                    "pass init_fn=lambda name, t: init_parameter_(t, name=name, ...)"
                )
            # The parameter's dtype, not the main params': a non-meta build rounds the init into
            # a bf16 weight before the fp32 main copy is made, and meta init must match it.
            full_value = self.tracker.empty(param.shape, dtype=param.dtype, device=self.device)
            init_fn(name, full_value)
        else:
            full_value = param.detach().to(self.device)
        group.storage.load_param_(index, full_value)
        if not group.main_is_alias:
            self._copy_to_main(group, index, full_value)

    def all_groups(self) -> Iterator[BufferGroup]:
        for unit in self.units:
            yield from unit.groups

    def persistent_bytes(self) -> dict[str, int]:
        totals = {"params": 0, "main_params": 0, "grads": 0}
        for group in self.all_groups():
            for role, nbytes in group.persistent_bytes().items():
                totals[role] += nbytes
        return totals

    def fp8_groups(self) -> list[BufferGroup]:
        return [g for g in self.all_groups() if isinstance(g.storage, Fp8ComputeStorage)]

    @torch.no_grad()
    def write_back_main_params(
        self,
        *,
        stats: CommStats | None = None,
        groups: list[BufferGroup] | None = None,
        update_scaling: bool = True,
    ) -> int:
        """After an optimizer step: main shards -> compute storage (+ replica all-gather).

        FP8 groups first agree on their amaxes: every group's partial amaxes are packed into
        ONE all-reduce MAX (never one per weight). Returns the bytes all-gathered (zero under
        ZeRO-3: the next forward gathers anyway); `stats` counts them.
        """
        groups = list(self.all_groups()) if groups is None else groups
        reduced = self._reduce_amaxes(groups, stats)
        gathered_bytes = 0
        works = []
        for group in groups:
            group.storage.write_main_shard(
                group.main_shard,
                reduced_amax=reduced.get(id(group)),
                update_scaling=update_scaling,
            )
            work, nbytes = group.storage.sync_replicas(async_op=True)
            gathered_bytes += nbytes
            if stats is not None:
                stats.add("all_gather_bytes", nbytes)
                if group.storage.gather_stats_key is not None:
                    stats.add(group.storage.gather_stats_key, nbytes)
            if work is not None:
                works.append(work)
        for work in works:
            work.wait()
        return gathered_bytes

    @torch.no_grad()
    def gather_outer_main_shards(self, stats: CommStats | None = None) -> None:
        """Outer optim, after a step: each replica updated its part of the main shard; gather
        the parts so every replica holds the whole updated shard (exact fp32 values, from which
        FP8 bytes and compute values are then written identically on every replica)."""
        if self.outer_group is None or not self.config.outer_shards_optimizer:
            return
        works = []
        for group in self.all_groups():
            shard = group.main_shard
            chunk = outer_chunk_numel(shard.numel(), outer_size=self.outer_size)
            lo, hi = group.optimizer_range
            part = torch.zeros(chunk, dtype=shard.dtype, device=shard.device)
            part[: hi - lo].copy_(shard[lo:hi])
            gathered = torch.empty(chunk * self.outer_size, dtype=shard.dtype, device=shard.device)
            works.append(
                (
                    group,
                    part,
                    gathered,
                    all_gather_flat(gathered, part, group=self.outer_group, async_op=True),
                )
            )
            if stats is not None:
                stats.add("outer_all_gather_bytes", gathered.numel() * gathered.element_size())
        for group, _, gathered, work in works:
            if work is not None:
                work.wait()
            group.main_shard.copy_(gathered[: group.main_shard.numel()])

    def _reduce_amaxes(
        self, groups: list[BufferGroup], stats: CommStats | None
    ) -> dict[int, torch.Tensor]:
        """id(group) -> its amax vector, MAX-reduced over the DP group where it is sharded."""
        vectors: dict[int, torch.Tensor] = {}
        for group in groups:
            amax = group.storage.amax_to_reduce(group.main_shard)
            if amax is not None:
                vectors[id(group)] = amax
        # Every rank holds the same groups, so all agree on whether to communicate.
        shared = [
            key
            for key, g in ((id(g), g) for g in groups)
            if key in vectors and g.layout.world_size > 1
        ]
        if shared:
            packed = torch.cat([vectors[key] for key in shared])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
            if stats is not None:
                stats.add("amax_all_reduce_bytes", packed.numel() * packed.element_size())
            for key, part in zip(shared, packed.split([vectors[k].numel() for k in shared])):
                vectors[key] = part
        return vectors
