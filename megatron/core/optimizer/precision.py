"""Precision-aware AdamW state: which dtypes the moments and main params may have, how scaled
states (fp16, fp8) are quantized, and the update itself in torch (the CPU path, and the twin the
Triton kernel is tested against).

Megatron-LM's `--use-precision-aware-optimizer` hands these choices to TransformerEngine's
FusedAdam: `--exp-avg-dtype` / `--exp-avg-sq-dtype` in fp32, fp16, bf16, fp8;
`--main-params-dtype` in fp32, fp16; `--main-grads-dtype` in fp32, bf16. TE keeps fp32 and bf16
states unscaled and fp16 and fp8 (E4M3) states with an fp32 scale per tensor, recomputed after
every update from the new state's amax: scale = amax / range, range 448 for E4M3 and half the
fp16 maximum for fp16, stored = round(value * (1 / scale)), a zero scale storing zeros.

Here the same rule is available per tensor ("tensor", TE's) or per block of `SCALE_BLOCK`
consecutive elements of the flat state ("block"): a block's scale is known inside the one pass
that updates it, and one outlier spoils only its block's resolution. The update reads every
state in fp32 (stored value times scale), computes torch's AdamW update in fp32, updates the
param from the fp32 moments, then rounds each state back into its dtype (round to nearest even,
saturating at the range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STATE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
"""Moment dtypes, by Megatron-LM's flag value (`--exp-avg-dtype`, `--exp-avg-sq-dtype`)."""

MAIN_PARAM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""Main-param dtypes Megatron-LM accepts (`--main-params-dtype`)."""

MAIN_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Main-grad dtypes Megatron-LM accepts (`--main-grads-dtype`)."""

SCALE_RULES = ("tensor", "block")

SCALE_BLOCK = 128
"""Elements per scale under the "block" rule: the tile width of the blockwise FP8 recipe, a
divisor of the Triton kernel's 4096-element program, 1/32 byte of scale per fp8 element."""

SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.float8_e4m3fn: 448.0}
"""Largest stored magnitude of a scaled state (TE's ranges): fp16 keeps a factor 2 of headroom,
E4M3 uses its whole range."""


def is_scaled(dtype: torch.dtype) -> bool:
    return dtype in SCALED_RANGE


@dataclass(frozen=True, kw_only=True)
class StatePrecision:
    """The dtypes of an AdamW's moments and how its scaled moments are scaled."""

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    scaling: str | None = "tensor"
    """"tensor" or "block" (SCALE_BLOCK elements); needed when a moment is fp16 or fp8."""

    @property
    def all_fp32(self) -> bool:
        return self.exp_avg_dtype == self.exp_avg_sq_dtype == torch.float32

    def dtype(self, name: str) -> torch.dtype:
        return self.exp_avg_dtype if name == "exp_avg" else self.exp_avg_sq_dtype


def _dtype_of(value: str | torch.dtype, table: dict[str, torch.dtype], flag: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in table.values():
        return value
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(
        f"{flag} {value}: unknown dtype; choose one of {', '.join(table)} (Megatron-LM's values)"
    )


def state_precision(
    *, exp_avg_dtype: str | torch.dtype, exp_avg_sq_dtype: str | torch.dtype, scaling: str | None
) -> StatePrecision:
    """Check a moment-dtype choice; a ValueError names the flag and the fix."""
    precision = StatePrecision(
        exp_avg_dtype=_dtype_of(exp_avg_dtype, STATE_DTYPES, "--exp-avg-dtype"),
        exp_avg_sq_dtype=_dtype_of(exp_avg_sq_dtype, STATE_DTYPES, "--exp-avg-sq-dtype"),
        scaling=scaling,
    )
    if scaling is not None and scaling not in SCALE_RULES:
        raise ValueError(
            f"moment scaling {scaling!r}: unknown scale rule; choose 'tensor' (TE's, one scale "
            f"per tensor) or 'block' (one per {SCALE_BLOCK} elements)"
        )
    for name, flag in (("exp_avg", "--exp-avg-dtype"), ("exp_avg_sq", "--exp-avg-sq-dtype")):
        if is_scaled(precision.dtype(name)) and scaling is None:
            raise ValueError(
                f"{flag} {_flag_value(precision.dtype(name))} needs a scale rule: give the "
                "moment scaling 'tensor' or 'block', or use bf16/fp32 moments"
            )
    return precision


def check_main_dtypes(
    *, main_params_dtype: str | torch.dtype, main_grads_dtype: str | torch.dtype
) -> tuple[torch.dtype, torch.dtype]:
    """The main-param and main-grad dtypes, checked against Megatron-LM's choices."""
    return (
        _dtype_of(main_params_dtype, MAIN_PARAM_DTYPES, "--main-params-dtype"),
        _dtype_of(main_grads_dtype, MAIN_GRAD_DTYPES, "--main-grads-dtype"),
    )


def _flag_value(dtype: torch.dtype) -> str:
    return next(name for name, value in STATE_DTYPES.items() if value == dtype)


def scale_numel(numel: int, *, dtype: torch.dtype, scaling: str | None) -> int:
    """Length of a state's scale vector: 0 unscaled, 1 per tensor, one per block."""
    if not is_scaled(dtype):
        return 0
    return 1 if scaling == "tensor" else math.ceil(numel / SCALE_BLOCK)


def _per_element(scale: torch.Tensor, numel: int) -> torch.Tensor:
    """A scale vector broadcast to a flat state of `numel` elements."""
    if scale.numel() == 1:
        return scale.reshape(1)
    return scale.repeat_interleave(SCALE_BLOCK)[:numel]


def dequantize(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value of a stored state (a new tensor, flat layout kept in `data`'s shape)."""
    values = data.float()
    if scale is None or scale.numel() == 0:
        return values if values.data_ptr() != data.data_ptr() else values.clone()
    flat = values.view(-1) * _per_element(scale, data.numel())
    return flat.view(data.shape)


@torch.no_grad()
def quantize_(values: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Round fp32 `values` into `data` (its dtype); a scaled state's new scale goes to `scale`
    from the new amax (per tensor, or per block of the flat state)."""
    if scale is None or scale.numel() == 0:
        data.copy_(values)
        return
    flat = values.reshape(-1).float()
    limit = SCALED_RANGE[data.dtype]
    if scale.numel() == 1:
        amax = flat.abs().amax().reshape(1) if flat.numel() else torch.zeros(1)
    else:
        padded = torch.zeros(scale.numel() * SCALE_BLOCK, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        amax = padded.view(-1, SCALE_BLOCK).abs().amax(dim=1)
    new_scale = amax / limit
    inverse = torch.where(new_scale > 0, 1.0 / new_scale, torch.zeros_like(new_scale))
    # An Inf amax gives an Inf scale and a zero inverse: the state is stored as zeros.
    scaled = (flat * _per_element(inverse, flat.numel())).clamp_(-limit, limit)
    data.view(-1).copy_(scaled)
    scale.copy_(new_scale)


@dataclass(frozen=True, kw_only=True)
class StepScalars:
    """The per-parameter numbers of one AdamW update (torch's fused AdamW's terms)."""

    decay_factor: float
    beta1: float
    beta2: float
    eps: float
    step_size: float
    bias_correction2_sqrt: float


def step_scalars(group: dict, step: int) -> StepScalars:
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    return StepScalars(
        decay_factor=1.0 - lr * group["weight_decay"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        step_size=lr / (1.0 - beta1**step),
        bias_correction2_sqrt=math.sqrt(1.0 - beta2**step),
    )


@torch.no_grad()
def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    scalars: StepScalars,
    grad_scale: torch.Tensor | None,
) -> None:
    """One AdamW update in torch, every state read in fp32 and rounded back into its dtype.

    The Triton kernel's formulas, term for term (decoupled decay, then the moments; the param
    moves by the unrounded fp32 moments). `state` holds "exp_avg"/"exp_avg_sq" (stored data)
    and, for fp16/fp8 moments, "exp_avg_scale"/"exp_avg_sq_scale" (fp32 scale vectors).
    """
    grad = grad.float()
    if grad_scale is not None:
        grad = grad / grad_scale.to(grad.device)
    exp_avg = dequantize(state["exp_avg"], state.get("exp_avg_scale"))
    exp_avg_sq = dequantize(state["exp_avg_sq"], state.get("exp_avg_sq_scale"))
    value = param.float() * scalars.decay_factor
    exp_avg = scalars.beta1 * exp_avg + (1.0 - scalars.beta1) * grad
    exp_avg_sq = scalars.beta2 * exp_avg_sq + (1.0 - scalars.beta2) * grad * grad
    denom = exp_avg_sq.sqrt() / scalars.bias_correction2_sqrt + scalars.eps
    value = value - scalars.step_size * exp_avg / denom
    param.copy_(value)
    quantize_(exp_avg, state["exp_avg"], state.get("exp_avg_scale"))
    quantize_(exp_avg_sq, state["exp_avg_sq"], state.get("exp_avg_sq_scale"))
