"""Sharded state dicts of the engine and its optimizer, in the form dist_checkpointing saves.

Model: {"params": {name: flat fp32 main param}, "param_shapes": {name: int64 shape tensor}},
plus, when some Fp8Linear uses delayed scaling, "fp8_delayed_scaling": {"<module>/<role>.scale"
and "<module>/<role>.amax_history": replicated tensors}. FP8 weights need nothing else: their
bytes are re-quantized from the fp32 main params on load, so a checkpoint resumes under any DP
size and any recipe (or none).
Optimizer (FsdpDistributedOptimizer.sharded_state_dict, built from the helpers here):
{"step": scalar, "<state key>": {name: flat state}} (exp_avg/exp_avg_sq for Adam,
momentum_buffer for SGD), always as fp32 values: bf16/fp16/fp8 moments (the precision-aware
optimizer) are saved as their logical fp32 values and rounded into the loading run's moment
dtypes, so a run resumes with other moment dtypes, at any DP size. Every flat value is the
parameter flattened to 1-D: a DTensor over the data-parallel mesh whose local piece is a *view*
of this rank's buffer (so DCP writes loads straight into it; a copy for non-fp32 or offloaded
moments) when main params are sharded (absent on a rank that holds none of the
parameter), or a plain replicated tensor under no_shard. A routed expert under expert
parallelism is recorded as its piece of the full [num_experts, ...] tensor (global expert
index; FlatValues), so the checkpoint loads at any expert-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.dist_checkpointing.flat_dtensor import (
    ExpertPlacement,
    data_parallel_mesh,
    flat_dtensor,
    flat_dtensor_runs,
    local_piece,
)
from megatron.core.dist_checkpointing.tp_placement import TensorParallelPlacement
from megatron.core.distributed.fsdp.buffer_group import BufferGroup
from megatron.core.distributed.fsdp.collectives import all_gather_flat
from megatron.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.shard_layout import LocalPiece, ParamSlot


def engine_mesh(engine: MegatronFSDP) -> Any:
    """The DP device mesh of the engine's flat DTensors (None under no_shard: no DTensors)."""
    if not engine.config.shards_optimizer_state:
        return None
    return data_parallel_mesh(engine.process_group, engine.buffer.device)


@dataclass(frozen=True)
class FlatValues:
    """Makes one parameter's flat value: over `mesh` (None under no_shard: a replicated plain
    tensor) at the piece's offset, or, for a routed expert under expert parallelism, at its
    place in the full [num_experts, ...] tensor (ExpertPlacement), or, for a parameter split
    over TP, as its runs in the full tensor (TensorParallelPlacement); the last two are
    DTensors even under no_shard (`placed_mesh`), since EP / TP ranks hold different values."""

    mesh: Any
    placement: ExpertPlacement | None = None
    placed_mesh: Any = None
    tp_placement: TensorParallelPlacement | None = None

    @classmethod
    def of(cls, engine: MegatronFSDP, mesh: Any) -> FlatValues:
        placement, tp_placement = engine.expert_placement, engine.tensor_parallel_placement
        if placement is None and tp_placement is None:
            return cls(mesh)
        placed_mesh = mesh or data_parallel_mesh(engine.process_group, engine.buffer.device)
        return cls(mesh, placement, placed_mesh, tp_placement)

    def __call__(
        self, slot: ParamSlot, piece: LocalPiece | None, view: torch.Tensor | None
    ) -> torch.Tensor | None:
        """None where the rank holds none of the parameter."""
        offset = 0 if piece is None else piece.param_start
        if self.placement is not None and slot.name in self.placement.names:
            offset, numel = self.placement.place(slot.name, offset, slot.numel)
            return flat_dtensor(view, offset=offset, global_numel=numel, mesh=self.placed_mesh)
        tp = self.tp_placement
        if tp is not None and slot.name in tp.splits:
            runs = [] if view is None else tp.runs(slot.name, offset, view.numel())
            return flat_dtensor_runs(
                view,
                [(run.local, run.full, run.length) for run in runs],
                global_numel=tp.global_numel(slot.name),
                mesh=self.placed_mesh,
            )
        if self.mesh is None:
            return view
        return flat_dtensor(view, offset=offset, global_numel=slot.numel, mesh=self.mesh)


def global_shape(engine: MegatronFSDP, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A parameter's shape in checkpoints: the full expert / TP tensor's."""
    for placement in (engine.expert_placement, engine.tensor_parallel_placement):
        if placement is not None:
            shape = placement.global_shape(name, shape)
    return tuple(shape)


def set_present(values: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:  # DCP would save a None as a pickled object
        values[name] = value


def _piece_of(group: BufferGroup, slot: ParamSlot) -> LocalPiece | None:
    return next((p for p in group.pieces() if p.slot is slot), None)


def named_slots(engine: MegatronFSDP):
    for group in engine.buffer.all_groups():
        for index, slot in enumerate(group.layout.slots):
            yield slot.name, group, index


def _delayed_owners(engine: MegatronFSDP) -> dict[str, Any]:
    root = engine.buffer.units[0].module
    return {
        name: module.delayed_scaling
        for name, module in root.named_modules()
        if getattr(module, "delayed_scaling", None) is not None
    }


def _delayed_state(engine: MegatronFSDP) -> dict[str, torch.Tensor]:
    state = {}
    for name, scaling in _delayed_owners(engine).items():
        for role, meta in scaling.metas.items():
            state[f"{name}/{role}.scale"] = meta.scale.detach().clone()
            state[f"{name}/{role}.amax_history"] = meta.amax_history.detach().clone()
    return state


@torch.no_grad()
def _load_delayed_state(engine: MegatronFSDP, state: dict[str, torch.Tensor]) -> None:
    for name, scaling in _delayed_owners(engine).items():
        for role, meta in scaling.metas.items():
            history = state[f"{name}/{role}.amax_history"]
            if history.shape != meta.amax_history.shape:
                raise ValueError(
                    f"checkpoint amax history of {name}/{role} has length {history.shape[0]}, "
                    f"this run uses {meta.amax_history.shape[0]}; set --fp8-amax-history-len"
                )
            meta.scale = state[f"{name}/{role}.scale"].to(meta.scale).clone()
            meta.amax_history = history.to(meta.amax_history).clone()


def model_sharded_state_dict(
    engine: MegatronFSDP, *, fp8_scaling_state: bool = True
) -> dict[str, Any]:
    params, shapes = {}, {}
    flat_value = FlatValues.of(engine, engine_mesh(engine))
    for name, group, index in named_slots(engine):
        slot = group.layout.slots[index]
        piece = _piece_of(group, slot)
        view = None
        if piece is not None:
            view = group.main_shard[piece.shard_start : piece.shard_start + piece.numel]
        set_present(params, name, flat_value(slot, piece, view))
        shapes[name] = torch.tensor(list(global_shape(engine, name, slot.shape)), dtype=torch.int64)
    state = {"params": params, "param_shapes": shapes}
    delayed = _delayed_state(engine) if fp8_scaling_state else {}
    if delayed:
        state["fp8_delayed_scaling"] = delayed
    return state


@torch.no_grad()
def _copy_into_main(engine: MegatronFSDP, params: dict[str, Any]) -> None:
    for name, group, index in named_slots(engine):
        piece = _piece_of(group, group.layout.slots[index])
        loaded = local_piece(params.get(name))
        if piece is None or loaded is None:
            continue
        dest = group.main_shard[piece.shard_start : piece.shard_start + piece.numel]
        if dest.data_ptr() != loaded.data_ptr():
            dest.copy_(loaded.reshape(-1))


def load_model_sharded_state_dict(engine: MegatronFSDP, state: dict[str, Any]) -> None:
    """Take loaded main params (in place or copied) and refresh the compute params from them.

    FP8 weights are re-quantized: with the loaded delayed-scaling state as it is (the scales
    the saving run would use next), or, for a checkpoint without it, from a fresh state.
    """
    _copy_into_main(engine, state["params"])
    buffer = engine.buffer
    if "fp8_delayed_scaling" in state:
        _load_delayed_state(engine, state["fp8_delayed_scaling"])
        buffer.write_back_main_params(update_scaling=False)
        return
    for group in buffer.fp8_groups():
        group.storage.reset_delayed_scaling()
    buffer.write_back_main_params()


@torch.no_grad()
def full_parameters(engine: MegatronFSDP) -> dict[str, torch.Tensor]:
    """All-gather every main shard and cut out each parameter (collective on every rank)."""
    result = {}
    for group in engine.buffer.all_groups():
        layout = group.layout
        full = torch.empty(
            layout.padded_numel, dtype=group.main_shard.dtype, device=group.main_shard.device
        )
        if layout.world_size == 1:
            full.copy_(group.main_shard)
        else:
            shard_group = group.process_group or engine.process_group  # experts: EDP group
            all_gather_flat(full, group.main_shard, group=shard_group, async_op=False)
        for slot in layout.slots:
            result[slot.name] = full[slot.offset : slot.end].view(slot.shape).clone()
    return result
