"""The replicated (DDP) optimizer's model and optimizer state in the sharded-checkpoint layout.

Same keys and flat 1-D values as Megatron-FSDP's state dicts
(megatron/core/distributed/fsdp/state_dict.py): model {"params": {name: flat fp32 main param},
"param_shapes": {name: int64 shape}}, optimizer {"step": scalar, "exp_avg"/"exp_avg_sq" (Adam)
or "momentum_buffer" (SGD): {name: flat state}}. Every value is a plain tensor, the same on
every rank: DCP writes each once (its planner deduplicates replicated entries) and every rank
reads all of them. Values are views of the optimizer's own tensors, so a load lands in place.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer


def _state_keys(optimizer: MixedPrecisionOptimizer) -> tuple[str, ...]:
    return (
        ("exp_avg", "exp_avg_sq") if optimizer.config.optimizer == "adam" else ("momentum_buffer",)
    )


def model_state_dict(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    named = optimizer.named_main_params()
    return {
        "params": {name: main.view(-1) for name, main in named.items()},
        "param_shapes": {
            name: torch.tensor(list(main.shape), dtype=torch.int64) for name, main in named.items()
        },
    }


@torch.no_grad()
def load_model_state_dict(optimizer: MixedPrecisionOptimizer, state: dict[str, Any]) -> None:
    """Main params were loaded in place: refresh the (bf16) model params from them."""
    optimizer.load_main_params(
        {
            name: state["params"][name].view(main.shape)
            for name, main in optimizer.named_main_params().items()
        }
    )


@torch.no_grad()
def _ensure_state(optimizer: MixedPrecisionOptimizer) -> None:
    """Zero state for every param without one (torch creates it at the first step): zero
    moments with step 0, or a zero momentum buffer, update exactly as fresh state does."""
    adam = optimizer.config.optimizer == "adam"
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


def optimizer_state_dict(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    _ensure_state(optimizer)
    torch_state = optimizer.optimizer.state
    result: dict[str, Any] = {
        key: {
            name: torch_state[main][key].view(-1)
            for name, main in zip(optimizer.main_param_names, optimizer.main_params)
        }
        for key in _state_keys(optimizer)
    }
    if optimizer.config.optimizer == "adam":
        steps = [torch_state[main]["step"] for main in optimizer.main_params]
        result["step"] = torch.stack([step.detach().float().cpu() for step in steps]).max()
    return result


@torch.no_grad()
def load_optimizer_state_dict(optimizer: MixedPrecisionOptimizer, state: dict[str, Any]) -> None:
    """Moments were loaded in place; the shared step count goes to every param's state."""
    if "step" not in state:
        return
    for main in optimizer.main_params:
        step = optimizer.optimizer.state[main]["step"]
        step.copy_(state["step"].to(step.device))
