"""The sharded part of a `--ckpt-format torch_dist` / `fsdp_dtensor` checkpoint: which state
dict each data-parallel engine gives, and the CPU copy an asynchronous save writes from.

Both engines give the same keys (model.params.<name>, model.param_shapes.<name>,
optimizer.<state key>.<name>, optimizer.step) holding each parameter flattened to 1-D:
Megatron-FSDP as DTensor pieces, DDP as replicated tensors. DCP records global shapes and
chunk offsets, so a checkpoint loads at any data-parallel size, strategy, or engine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.flat_dtensor import flat_dtensor, local_piece, piece_offset
from megatron.core.optimizer.sharded_state import (
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
)

SHARDED_FORMATS = ("torch_dist", "fsdp_dtensor")


def _is_fsdp(run) -> bool:
    return hasattr(run.model, "sharded_state_dict")


def sharded_state(run, *, optimizer: bool, fp8_scaling_state: bool = True) -> dict[str, Any]:
    """The DCP state dict of `run`'s model (and optimizer): views of the live tensors."""
    if _is_fsdp(run):
        state = {"model": run.model.sharded_state_dict(fp8_scaling_state=fp8_scaling_state)}
        if optimizer:
            state["optimizer"] = run.optimizer.sharded_state_dict()
        return state
    state = {"model": model_state_dict(run.optimizer)}
    if optimizer:
        state["optimizer"] = optimizer_state_dict(run.optimizer)
    return state


def load_sharded_state(run, state: dict[str, Any]) -> None:
    """Take a state dict that DCP filled in place: refresh compute params, optimizer step."""
    if _is_fsdp(run):
        run.model.load_sharded_state_dict(state["model"])
        if "optimizer" in state:
            run.optimizer.load_sharded_state_dict(state["optimizer"])
        return
    load_model_state_dict(run.optimizer, state["model"])
    if "optimizer" in state:
        load_optimizer_state_dict(run.optimizer, state["optimizer"])


@torch.no_grad()
def stage_to_cpu(state: Any, *, cpu_mesh: DeviceMesh) -> Any:
    """A copy of `state` in CPU memory of its own, for a writer thread: training goes on
    updating the live buffers while the copy is written. DTensor pieces keep their offsets
    (on `cpu_mesh`, a mesh over the writer's gloo group)."""
    if isinstance(state, dict):
        return {key: stage_to_cpu(value, cpu_mesh=cpu_mesh) for key, value in state.items()}
    if isinstance(state, DTensor):
        piece = local_piece(state).detach().to("cpu", copy=True)
        return flat_dtensor(
            piece, offset=piece_offset(state), global_numel=state.shape[0], mesh=cpu_mesh
        )
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state
