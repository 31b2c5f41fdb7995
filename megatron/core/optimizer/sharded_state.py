"""The MixedPrecisionOptimizer's model and optimizer state (DDP, or PyTorch FSDP2) in the
sharded-checkpoint layout.

Same keys and flat 1-D values as Megatron-FSDP's state dicts
(megatron/core/distributed/fsdp/state_dict.py): model {"params": {name: flat fp32 main param},
"param_shapes": {name: int64 shape}}, optimizer {"step": scalar, "exp_avg"/"exp_avg_sq" (Adam)
or "momentum_buffer" (SGD): {name: flat state}}. Every value is a plain tensor, the same on
every rank: DCP writes each once (its planner deduplicates replicated entries) and every rank
reads all of them. Under FSDP2 the params and moments are row-sharded DTensors, each given as
its rank's contiguous piece of the flat value (flat_row_shard), as Megatron-FSDP gives its
pieces: the checkpoint loads under DDP, FSDP2 or Megatron-FSDP, at any data-parallel size.
With expert parallelism each routed expert is its EP rank's piece of the full
[num_experts, ...] tensor (ExpertPlacement; the EDP replicas write it once), so the
checkpoint also loads at any expert-parallel size; with tensor parallelism each TP shard is
its runs in the full (TP = 1) tensor (TensorParallelPlacement), so it loads at any TP size.
Values are views of the optimizer's own tensors, so a load lands in place (a piece DCP did not
fill in place is copied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.flat_dtensor import (
    data_parallel_mesh,
    flat_dtensor,
    flat_dtensor_runs,
    flat_row_shard,
    local_piece,
)
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer


def _state_keys(optimizer: MixedPrecisionOptimizer) -> tuple[str, ...]:
    return (
        ("exp_avg", "exp_avg_sq") if optimizer.config.optimizer == "adam" else ("momentum_buffer",)
    )


def _flat(tensor: torch.Tensor) -> torch.Tensor | None:
    """The flat checkpoint value of a param or moment: a view, or this rank's piece of a
    row-sharded DTensor (None where the rank holds no row: the key is left out)."""
    return flat_row_shard(tensor) if isinstance(tensor, DTensor) else tensor.view(-1)


def _flattener(optimizer: MixedPrecisionOptimizer) -> Callable[[str, torch.Tensor], Any]:
    """_flat, but a routed expert under expert parallelism (which differs across the EP
    ranks) is its rank's piece of the full [num_experts, ...] tensor (ExpertPlacement), and
    a tensor-parallel shard its runs in the full tensor (TensorParallelPlacement)."""
    placement, tp = optimizer.expert_placement, optimizer.tensor_parallel_placement
    if placement is None and tp is None:
        return lambda name, tensor: _flat(tensor)
    device = optimizer.main_params[0].device
    group = optimizer.expert_parallel_group if tp is None else optimizer.grad_group
    mesh = data_parallel_mesh(group, device)

    def flat(name: str, tensor: torch.Tensor) -> Any:
        if placement is not None and name in placement.names:
            offset, numel = placement.place(name, 0, tensor.numel())
            return flat_dtensor(tensor, offset=offset, global_numel=numel, mesh=mesh)
        if tp is not None and name in tp.splits:
            runs = [(r.local, r.full, r.length) for r in tp.runs(name, 0, tensor.numel())]
            return flat_dtensor_runs(tensor, runs, global_numel=tp.global_numel(name), mesh=mesh)
        return _flat(tensor)

    return flat


def _global_shape(optimizer: MixedPrecisionOptimizer, name: str, shape) -> tuple[int, ...]:
    for placement in (optimizer.expert_placement, optimizer.tensor_parallel_placement):
        if placement is not None:
            shape = placement.global_shape(name, shape)
    return tuple(shape)


def _present(values: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in values.items() if value is not None}


@torch.no_grad()
def _take_loaded(dest: torch.Tensor, loaded: torch.Tensor | None) -> None:
    """Copy a piece that DCP loaded elsewhere than into `dest`'s own storage (a DTensor
    piece: an FSDP2 shard, or a routed expert's piece of the full expert tensor)."""
    piece = local_piece(loaded)
    if not isinstance(loaded, DTensor) or piece is None:
        return
    local = dest.to_local() if isinstance(dest, DTensor) else dest
    if local.data_ptr() != piece.data_ptr():
        local.view(-1).copy_(piece.reshape(-1))


def model_state_dict(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    named = optimizer.named_main_params()
    flat = _flattener(optimizer)
    shapes = {name: _global_shape(optimizer, name, main.shape) for name, main in named.items()}
    return {
        "params": _present({name: flat(name, main) for name, main in named.items()}),
        "param_shapes": {
            name: torch.tensor(list(shape), dtype=torch.int64) for name, shape in shapes.items()
        },
    }


@torch.no_grad()
def load_model_state_dict(optimizer: MixedPrecisionOptimizer, state: dict[str, Any]) -> None:
    """Main params were loaded in place: refresh the (bf16) model params from them."""
    named = optimizer.named_main_params()
    if any(isinstance(main, DTensor) for main in named.values()):
        # FSDP2: the fp32 shards are the model params themselves.
        for name, main in named.items():
            _take_loaded(main, state["params"].get(name))
        return
    optimizer.load_main_params(
        {name: local_piece(state["params"][name]).view(main.shape) for name, main in named.items()}
    )


@torch.no_grad()
def _ensure_state(optimizer: MixedPrecisionOptimizer) -> None:
    """Zero state for every param without one (torch creates it at the first step): zero
    moments with step 0, or a zero momentum buffer, update exactly as fresh state does."""
    adam = optimizer.config.optimizer == "adam"
    if adam and hasattr(optimizer.optimizer, "init_state"):  # FusedAdamW, OffloadedAdamW
        optimizer.optimizer.init_state()  # their own dtypes and scales (and host parts)
        return
    for main in optimizer.main_params:
        state = optimizer.optimizer.state[main]
        if state:
            continue
        if adam:
            fused = optimizer.optimizer.defaults.get("fused") or False
            device = main.device if fused else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for key in _state_keys(optimizer):
            state[key] = torch.zeros_like(main)


def _moments(optimizer: MixedPrecisionOptimizer, main: torch.Tensor) -> dict[str, torch.Tensor]:
    """The param's optimizer states as checkpoint values: its own tensors where no moment is
    scaled (fp32 or bf16: their elements are the values, and DCP loads into them in place,
    converting the dtype), else the fp32 logical values of its moments (new tensors: a scaled
    fp16 / fp8 moment's bytes alone are not its values), as Megatron-FSDP saves them."""
    keys, state = _state_keys(optimizer), optimizer.optimizer.state[main]
    if not _scaled(state, keys):
        return {key: state[key] for key in keys}
    logical = optimizer.optimizer.logical_state(main)
    return {key: logical[key].view(main.shape) for key in keys}


def _scaled(state: dict, keys: tuple[str, ...]) -> bool:
    return any(state.get(f"{key}_scale") is not None for key in keys)


def optimizer_state_dict(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    _ensure_state(optimizer)
    torch_state = optimizer.optimizer.state
    flat = _flattener(optimizer)
    names = optimizer.main_param_names
    moments = {name: _moments(optimizer, main) for name, main in zip(names, optimizer.main_params)}
    result: dict[str, Any] = {
        key: _present({name: flat(name, moments[name][key]) for name in names})
        for key in _state_keys(optimizer)
    }
    if optimizer.config.optimizer == "adam":
        steps = [torch_state[main]["step"] for main in optimizer.main_params]
        result["step"] = torch.stack([step.detach().float().cpu() for step in steps]).max()
    return result


@torch.no_grad()
def load_optimizer_state_dict(optimizer: MixedPrecisionOptimizer, state: dict[str, Any]) -> None:
    """Unscaled moments were loaded in place (a piece elsewhere is copied); scaled ones are
    rounded into their dtype and scales from the loaded fp32 values; the shared step count
    goes to every param's state."""
    torch_state, keys = optimizer.optimizer.state, _state_keys(optimizer)
    for name, main in zip(optimizer.main_param_names, optimizer.main_params):
        if not _scaled(torch_state[main], keys):
            for key in keys:
                _take_loaded(torch_state[main][key], state[key].get(name))
            continue
        loaded = {key: local_piece(state[key][name]).reshape(main.shape) for key in keys}
        optimizer.optimizer.set_logical_state(main, loaded)
    if "step" not in state:
        return
    for main in optimizer.main_params:
        step = optimizer.optimizer.state[main]["step"]
        step.copy_(state["step"].to(step.device))
