"""The sharded part of a `--ckpt-format torch_dist` / `fsdp_dtensor` checkpoint: which state
dict each data-parallel engine gives (an asynchronous save writes from a host copy of it,
staging.py).

Every engine gives the same keys (model.params.<name>, model.param_shapes.<name>,
optimizer.<state key>.<name>, optimizer.step) holding each parameter flattened to 1-D:
Megatron-FSDP and FSDP2 (through the MixedPrecisionOptimizer, as DDP) as DTensor pieces, DDP
as replicated tensors. DCP records global shapes and
chunk offsets, so a checkpoint loads at any data-parallel size, strategy, or engine.
"""

from __future__ import annotations

from typing import Any

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
        else:  # --no-load-optim: CPU offload's host copies follow the loaded main params
            run.optimizer.refresh_offloaded_params()
        return
    load_model_state_dict(run.optimizer, state["model"])
    if "optimizer" in state:
        load_optimizer_state_dict(run.optimizer, state["optimizer"])
