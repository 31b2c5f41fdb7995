"""Flat per-unit buffers: compute params, fp32 main params and grads, and their shard views.

Every FSDP unit (a TransformerLayer, or the root: everything outside the layers) owns one
`buffer_group.BufferGroup` per storage kind (today: one per parameter dtype; with FP8, quantized
weights and the bf16 rest). One builder makes every group; only its compute storage differs,
made by a factory (`DenseComputeStorage`, or `Fp8ComputeStorage` over an FP8 layout). A group
holds, per role, one flat buffer laid out by `shard_layout`:

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

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.buffer_group import BufferGroup, FsdpUnit
from megatron.core.distributed.fsdp.collectives import CommStats, all_gather_flat
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.fp8_layout import plan_fp8_layout
from megatron.core.distributed.fsdp.fp8_params import (
    Fp8ParamSpec,
    fp8_param_spec,
    materialize_delayed_scaling,
)
from megatron.core.distributed.fsdp.fp8_storage import Fp8ComputeStorage
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import (
    UnitLayout,
    build_unit_layout,
    outer_chunk_numel,
    outer_shard_range,
)
from megatron.core.distributed.fsdp.storage import ComputeStorage, DenseComputeStorage
from megatron.core.fp8.engine_interface import (
    QuantizedTensor,
    forget_high_precision_init_value,
    high_precision_init_value,
)

InitFn = Callable[[str, torch.Tensor], None]


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
        expert_group: dist.ProcessGroup | None = None,
        expert_param_names: frozenset[str] = frozenset(),
        tensor_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        """convert_fp8_linears: keep every Fp8Linear weight in FP8 (fp8_param_gather), even one
        built in high precision; QuantizedTensor parameters are kept in FP8 regardless.
        group: the shard group; outer_group: the replica group under HSDP (None otherwise).
        expert_group: with expert parallelism, the expert-data-parallel group the parameters
        named in expert_param_names are sharded and reduced over, in buffer groups of their
        own (the second mesh); every other parameter uses `group`. tensor_parallel_group: the
        parameters are TP shards; per-tensor FP8 scales agree over it (whole-weight amax)."""
        self.config = config
        self.tensor_parallel_group = tensor_parallel_group
        self.convert_fp8_linears = convert_fp8_linears
        self.group = group
        self.expert_group = expert_group
        self.expert_param_names = expert_param_names if expert_group is not None else frozenset()
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
        buckets: dict[object, list[tuple[list[str], nn.Parameter]]] = {}
        specs: dict[object, Fp8ParamSpec | None] = {}
        delayed_metas: dict[object, list] = {}
        for names, param in named:
            spec = fp8_param_spec(
                module, names[0], param, convert_fp8_linears=self.convert_fp8_linears
            )
            expert = names[0] in self.expert_param_names
            key = (param.dtype if spec is None else spec.group_key, expert)
            buckets.setdefault(key, []).append((names, param))
            specs.setdefault(key, spec)
            delayed_metas.setdefault(key, []).append(None if spec is None else spec.delayed_meta)
        for key, members in buckets.items():
            shapes = [(names[0], param.shape) for names, param in members]
            process_group = self.expert_group if key[1] else None
            if specs[key] is None:
                storage = self._dense_storage(key[0], shapes, process_group=process_group)
            else:
                storage = self._fp8_storage(
                    specs[key], shapes, delayed_metas[key], process_group=process_group
                )
            group = self._build_group(members, storage, init_fn)
            group.process_group = process_group
            unit.groups.append(group)
            for (names, _), new_param in zip(members, group.params):
                _replace_parameter(module, names, new_param)
                self.param_names[new_param] = names

    def _shard_world(self, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
        """(world size, rank) of the layouts: the DP group (or `group`, the expert-data-parallel
        one), or one rank for no_shard."""
        if not self.config.shards_optimizer_state:
            return 1, 0
        if group is not None:
            return dist.get_world_size(group), dist.get_rank(group)
        return self.world_size, self.rank

    def _dense_storage(
        self,
        dtype: torch.dtype,
        shapes: list[tuple[str, torch.Size]],
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> DenseComputeStorage:
        world_size, rank = self._shard_world(process_group)
        layout = build_unit_layout(
            shapes,
            world_size=world_size,
            rank=rank,
            param_alignment=DenseComputeStorage.param_alignment,
        )
        return DenseComputeStorage(
            layout=layout,
            dtype=dtype,
            main_dtype=self.config.main_params_dtype,
            device=self.device,
            sharded=self.config.shards_params,
            group=process_group if process_group is not None else self.group,
            tracker=self.tracker,
        )

    def _fp8_storage(
        self,
        spec: Fp8ParamSpec,
        shapes: list[tuple[str, torch.Size]],
        delayed_metas: list,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> Fp8ComputeStorage:
        if self.config.main_params_dtype != torch.float32:
            raise ValueError(
                "Megatron-FSDP with FP8 parameters needs fp32 main params (the exact values FP8 "
                f"is re-quantized from); got --main-params-dtype {self.config.main_params_dtype}"
            )
        world_size, rank = self._shard_world(process_group)
        layout, scales_sharded = plan_fp8_layout(
            shapes, spec.recipe_spec, world_size=world_size, rank=rank
        )
        return Fp8ComputeStorage(
            layout=layout,
            scales_sharded=scales_sharded,
            spec=spec,
            delayed_metas=delayed_metas,
            device=self.device,
            sharded=self.config.shards_params,
            group=process_group if process_group is not None else self.group,
            tracker=self.tracker,
        )

    def _build_group(
        self,
        members: list[tuple[list[str], nn.Parameter]],
        storage: ComputeStorage,
        init_fn: InitFn | None,
    ) -> BufferGroup:
        """A group over `storage` (dense or FP8): its main shard (the compute shard itself where
        the storage allows, else a fresh one) seeded with every member's exact value, holding
        at most one full parameter at a time, and the new buffer-backed parameters."""
        alias = storage.main_shard_alias(self.config.main_params_dtype)
        group = self._new_group(members, storage.layout, storage, main_shard=alias)
        storage.bind_main_shard(group.main_shard)  # aligned mxfp8 quantizes from it at gathers
        for index, (names, param) in enumerate(members):
            full_value = self._full_value(names[0], param, init_fn)
            storage.load_param_(index, full_value)
            if not group.main_is_alias:
                self._copy_to_main(group, index, full_value)
            forget_high_precision_init_value(param)
        group.params = [
            storage.new_param(index, requires_grad=param.requires_grad)
            for index, (_, param) in enumerate(members)
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

    @torch.no_grad()
    def _full_value(self, name: str, param: torch.Tensor, init_fn: InitFn | None):
        """The exact full value of a parameter, on this device: init_fn on meta (drawn in the
        parameter's own dtype, as a non-meta build holds it: init rounds its fp32 draw into
        the tensor, so meta init starts from the same bf16 values), else the value
        quantized_model_init kept, else the parameter itself. Only an FP8 parameter built
        without a kept value falls back to its (lossy) dequantized bytes."""
        if param.is_meta:
            if init_fn is None:
                raise ValueError(
                    f"FSDP: parameter {name!r} is on the meta device but no init_fn was given; "
                    "pass init_fn=lambda name, t: init_parameter_(t, name=name, ...)"
                )
            full_value = self.tracker.empty(param.shape, dtype=param.dtype, device=self.device)
            init_fn(name, full_value)
            return full_value
        kept = high_precision_init_value(param)
        if kept is not None:
            return kept.to(self.device, torch.float32)
        if isinstance(param, QuantizedTensor):
            return param.dequantize(torch.float32).to(self.device)
        return param.detach().to(self.device)

    @torch.no_grad()
    def _copy_to_main(self, group: BufferGroup, index: int, full_value: torch.Tensor) -> None:
        flat = full_value.reshape(-1)
        for piece in group.layout.pieces():
            if piece.slot is group.layout.slots[index]:
                src = flat[piece.param_start : piece.param_start + piece.numel]
                group.main_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(src)

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
        """id(group) -> its amax vector, MAX-reduced where it is sharded: over the DP group, and
        routed experts' over their expert-data-parallel group (one all-reduce per group)."""
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
        by_group = {id(g): g.process_group for g in groups}
        for process_group in dict.fromkeys((None, self.expert_group)):
            keys = [key for key in shared if by_group[key] is process_group]
            if not keys:
                continue
            packed = torch.cat([vectors[key] for key in keys])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group or self.group)
            if stats is not None:
                stats.add("amax_all_reduce_bytes", packed.numel() * packed.element_size())
            for key, part in zip(keys, packed.split([vectors[k].numel() for k in keys])):
                vectors[key] = part
        if self.tensor_parallel_group is not None:
            per_tensor = [
                g for g in groups if id(g) in vectors and g.storage.spec.recipe_spec.per_tensor
            ]
            max_over_tensor_parallel_(vectors, per_tensor, self.tensor_parallel_group, stats)
        return vectors


def max_over_tensor_parallel_(
    vectors: dict[int, torch.Tensor], groups: list[BufferGroup], tp_group, stats
) -> None:
    """Per-tensor FP8 scales of TP shards cover the whole logical weight: MAX their amax
    vectors (same layout on every TP rank) over the TP group, in one all-reduce."""
    if not groups:
        return
    packed = torch.cat([vectors[id(g)] for g in groups])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=tp_group)
    if stats is not None:
        stats.add("amax_all_reduce_bytes", packed.numel() * packed.element_size())
    for group, part in zip(groups, packed.split([vectors[id(g)].numel() for g in groups])):
        vectors[id(group)] = part
