"""Flat per-unit buffers: compute params, fp32 main params and grads, and their shard views.

Every FSDP unit (a TransformerLayer, or the root: everything outside the layers) owns one
`BufferGroup` per storage kind (today: one per parameter dtype; with FP8, quantized weights and
the bf16 rest). A group holds, per role, one flat buffer laid out by `shard_layout`:

| role           | no_shard | optim      | optim_grads | optim_grads_params |
|----------------|----------|------------|-------------|--------------------|
| compute params | full     | full       | full        | shard (+ full while gathered) |
| main params    | full     | shard      | shard       | shard              |
| grads          | full     | full       | shard       | shard              |

When the compute dtype equals main_params_dtype the main params *are* the compute buffer's
shard (no second copy, as FSDP2 does for fp32 params). Grad buffers are allocated at the first
backward (or when the optimizer is built), so building a model never holds them.

no_shard uses a one-rank layout (no padding; the "shard" is the whole buffer); the other
strategies pad each group to a multiple of the DP size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import LocalPiece, UnitLayout, build_unit_layout
from megatron.core.distributed.fsdp.storage import ComputeStorage, DenseComputeStorage

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

    def pieces(self) -> list[LocalPiece]:
        return self.layout.pieces()

    def ensure_grad_buffer(self) -> torch.Tensor:
        if self.grad_buffer is None:
            numel = self.layout.shard_numel if self.shards_grads else self.layout.padded_numel
            self.grad_buffer = self.tracker.zeros(numel, dtype=self.grad_dtype, device=self.device)
        return self.grad_buffer

    def grad_shard(self) -> torch.Tensor:
        """Grads of this rank's main shard (after the reduction of the step is complete)."""
        grads = self.ensure_grad_buffer()
        if self.shards_grads:
            return grads
        lo, hi = self.layout.shard_range(self.layout.rank)
        return grads[lo:hi]

    @torch.no_grad()
    def add_param_grad(self, index: int, grad: torch.Tensor) -> None:
        """Put one parameter's micro-batch grad where the strategy accumulates it."""
        slot = self.layout.slots[index]
        if self.shards_grads:
            if self.staging is None:
                # Zeros: padding and params without a grad this micro-batch contribute nothing.
                self.staging = self.tracker.zeros(
                    self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device
                )
            self.staging[slot.offset : slot.end].copy_(grad.reshape(-1))
        else:
            self.ensure_grad_buffer()[slot.offset : slot.end].add_(grad.reshape(-1))

    def zero_grads(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        self.staging = None

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
    ) -> None:
        self.config = config
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.tracker = MemoryTracker()
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

    def _build_unit(
        self,
        module: nn.Module,
        unit: FsdpUnit,
        named: list[tuple[list[str], nn.Parameter]],
        init_fn: InitFn | None,
    ) -> None:
        by_dtype: dict[torch.dtype, list[tuple[list[str], nn.Parameter]]] = {}
        for names, param in named:
            by_dtype.setdefault(param.dtype, []).append((names, param))
        for dtype, members in by_dtype.items():
            group = self._build_group(dtype, members, init_fn)
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
            device=self.device,
            sharded=config.shards_params,
            group=self.group,
            tracker=self.tracker,
        )
        alias = storage.main_shard_alias(config.main_params_dtype)
        main_shard = alias
        if main_shard is None:
            main_shard = self.tracker.zeros(
                layout.shard_numel, dtype=config.main_params_dtype, device=self.device
            )
        reduce_dtype = torch.bfloat16 if config.grad_reduce_in_bf16 else config.main_grads_dtype
        group = BufferGroup(
            names=[names[0] for names, _ in members],
            params=[],
            layout=layout,
            storage=storage,
            main_shard=main_shard,
            main_is_alias=alias is not None,
            grad_dtype=config.main_grads_dtype,
            reduce_dtype=reduce_dtype,
            shards_grads=config.shards_grads,
            device=self.device,
            tracker=self.tracker,
        )
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
            full_value = self.tracker.empty(
                param.shape, dtype=self.config.main_params_dtype, device=self.device
            )
            init_fn(name, full_value)
        else:
            full_value = param.detach().to(self.device)
        group.storage.load_param_(index, full_value)
        if not group.main_is_alias:
            for piece in group.layout.pieces():
                if piece.slot is group.layout.slots[index]:
                    src = full_value.reshape(-1)[
                        piece.param_start : piece.param_start + piece.numel
                    ]
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

    @torch.no_grad()
    def write_back_main_params(self) -> int:
        """After an optimizer step: main shards -> compute storage (+ replica all-gather).

        Returns the bytes all-gathered (zero under ZeRO-3: the next forward gathers anyway).
        """
        gathered_bytes = 0
        works = []
        for group in self.all_groups():
            group.storage.write_main_shard(group.main_shard)
            work, nbytes = group.storage.sync_replicas(async_op=True)
            gathered_bytes += nbytes
            if work is not None:
                works.append(work)
        for work in works:
            work.wait()
        return gathered_bytes
