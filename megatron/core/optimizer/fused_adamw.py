"""AdamW whose CUDA step is one Triton pass per parameter, with moments in fp32, bf16, fp16 or
fp8 (precision.py), optionally reporting max |param|.

torch's fused AdamW (multi-tensor apply) moved about 3.3 TB/s on an H200: 18.7 ms of a Model A
step for 2.2 B fp32 params (28 bytes per element read and written). One flat pass per
parameter moves the same bytes closer to copy bandwidth. It also returns what FP8 parameters
need next: the amax of each updated weight, or of each of its scale cells (`amax_targets`,
`AmaxCells`: 128x128 blocks, one cell per stacked expert), so the re-quantization after the
step does not read every fp32 weight a second time to find them.

The update is torch's fused AdamW's, term for term (decoupled decay, moments, bias corrections,
`grad_scale` dividing each grad as AMP's unscaling does). With fp32 moments the state (`step`,
`exp_avg`, `exp_avg_sq`, on the param's device) and the state dict are torch.optim.AdamW's, so
checkpoints do not change, and where the kernel is not used (CPU, no Triton, amsgrad/maximize,
or `use_triton=False`) `step` is torch.optim.AdamW's own. Other moment dtypes keep the stored
moments in their dtype (plus `exp_avg_scale` / `exp_avg_sq_scale` for fp16 and fp8) and, off
the kernel, run precision.adamw_update_, the kernel's math in torch. The main params (the
optimizer's params) may be fp32, fp16 or bf16: the update is computed in fp32 and rounded into
them. The state dict holds every state in its stored dtype; a load converts each state into
this optimizer's dtypes, so a run resumes with other moment dtypes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from megatron.core.numerics import amax_ignoring_nan
from megatron.core.optimizer.precision import (
    StatePrecision,
    adamw_update_,
    dequantize,
    quantize_,
    scale_numel,
    state_precision,
    step_scalars,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


@functools.cache
def _triton_kernel():
    """megatron.core.optimizer.triton_adamw, or None without Triton."""
    try:
        from megatron.core.optimizer import triton_adamw
    except ImportError:
        return None
    return triton_adamw


class AmaxCells(NamedTuple):
    """Where a step reports the amax of each scale cell of an updated parameter: the parameter
    is elements `start`.. of a row-major weight of `cols` columns, cut into cells of
    `cell_rows` x `cell_cols` elements (an edge longer than the weight: whole rows or
    columns), whose fp32 amaxes lie row-major in `cells`, `grid_cols` per row of cells. The
    step raises each cell to the max |value| of its updated elements; `measure_(values)` does
    it from a flat piece outside the kernel (the FP8 package's own rule, bitwise the same)."""

    cells: torch.Tensor
    cols: int
    cell_rows: int
    cell_cols: int
    grid_cols: int
    start: int
    measure_: Callable[[torch.Tensor], None]

    def groups_in_one_cell(self, group: int) -> bool:
        """Whether every `group` consecutive elements from `start` (group-aligned in the
        weight) lie in one cell: the fused kernel's one atomic max per group."""
        whole_rows = self.cell_cols >= self.cols or self.cell_cols % group == 0
        return self.cols % group == 0 and self.start % group == 0 and whole_rows


class FusedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with precision-aware moments, a Triton CUDA step and optional
    per-parameter amax output.

    exp_avg_dtype / exp_avg_sq_dtype: "fp32", "bf16", "fp16", "fp8" (or the torch dtype);
    moment_scaling: "tensor" or "block", the scale rule of fp16/fp8 moments (None refuses
    them); use_triton: False runs the torch step on CUDA too (A/B measurements).
    amax_targets: {param: 0-d fp32 tensor or AmaxCells}; each step raises the tensor to max
    |param| (each cell to its elements' max) after the update (callers zero them first).
    Params without a grad this step are still measured.
    """

    def __init__(
        self,
        params,
        *,
        exp_avg_dtype: str | torch.dtype = "fp32",
        exp_avg_sq_dtype: str | torch.dtype = "fp32",
        moment_scaling: str | None = "tensor",
        use_triton: bool = True,
        **kwargs,
    ) -> None:
        self.precision: StatePrecision = state_precision(
            exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, scaling=moment_scaling
        )
        super().__init__(params, **kwargs)
        self.use_triton = use_triton
        self.amax_targets: dict[torch.Tensor, torch.Tensor | AmaxCells] = {}
        self._host_steps: dict[torch.Tensor, int] = {}

    def _torch_adamw_step(self) -> bool:
        """torch.optim.AdamW's own step applies: fp32 moments over fp32 params and grads."""
        return self.precision.all_fp32 and all(
            param.dtype == torch.float32 and (param.grad is None or param.grad.dtype == param.dtype)
            for group in self.param_groups
            for param in group["params"]
        )

    def _triton_usable(self) -> bool:
        if not self.use_triton or _triton_kernel() is None:
            return False
        for group in self.param_groups:
            if not group.get("fused") or group["amsgrad"] or group["maximize"]:
                return False
            for param in group["params"]:
                usable = (
                    type(param) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor (FSDP2)
                    and param.is_cuda
                    and param.dtype in (torch.float32, torch.float16, torch.bfloat16)
                    and param.is_contiguous()
                )
                if not usable:
                    return False
        return True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        if closure is not None:
            raise ValueError("FusedAdamW.step takes no closure")
        triton = self._triton_usable()
        if not triton and self._torch_adamw_step():
            super().step()
            self._measure_amaxes(self.amax_targets)
            return None
        if not triton and any(g["amsgrad"] or g["maximize"] for g in self.param_groups):
            raise ValueError("FusedAdamW with non-fp32 moments or params: no amsgrad/maximize")
        grad_scale = getattr(self, "grad_scale", None)
        step_tensors, unmeasured = [], {}
        for group in self.param_groups:
            for param in group["params"]:
                amax = self.amax_targets.get(param)
                if param.grad is None:
                    if amax is not None:
                        unmeasured[param] = amax
                    continue
                state = self.state_of(param)
                step = self._host_steps[param] = self._host_step(param, state) + 1
                scalars = step_scalars(group, step)
                if triton:
                    if not self._kernel_step(param, state, scalars, grad_scale, amax):
                        unmeasured[param] = amax
                else:
                    adamw_update_(param, param.grad, state, scalars=scalars, grad_scale=grad_scale)
                    if amax is not None:
                        unmeasured[param] = amax
                step_tensors.append(state["step"])
        if step_tensors:
            torch._foreach_add_(step_tensors, 1.0)
        self._measure_amaxes(unmeasured)
        return None

    def _kernel_step(self, param, state, scalars, grad_scale, amax) -> bool:
        """The Triton step of one param; False when `amax` (cells the kernel cannot group)
        is left for `_measure_amaxes`."""
        grad = param.grad if param.grad.is_contiguous() else param.grad.contiguous()
        kernel = _triton_kernel()
        fused = not isinstance(amax, AmaxCells) or amax.groups_in_one_cell(kernel.CELL_GROUP)
        kernel.adamw_step_(
            param,
            grad,
            exp_avg=state["exp_avg"],
            exp_avg_sq=state["exp_avg_sq"],
            exp_avg_scale=state.get("exp_avg_scale"),
            exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
            scalars=scalars,
            grad_scale=grad_scale,
            amax=amax if fused else None,
        )
        return fused

    def init_state(self) -> None:
        """Create every param's state now (zero moments, step 0), e.g. for a checkpoint
        template; it updates exactly as the state created lazily at the first step."""
        for group in self.param_groups:
            for param in group["params"]:
                self.state_of(param)

    @torch.no_grad()
    def state_of(self, param: torch.Tensor) -> dict:
        """The param's state in this optimizer's dtypes: created when missing (zeros), and
        converted when it holds other dtypes (a load, or state made by another owner)."""
        state = self.state[param]
        if "step" not in state:
            fused = self._group_of(param).get("fused")
            device = param.device if fused else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for name in MOMENTS:
            dtype = self.precision.dtype(name)
            scales = scale_numel(param.numel(), dtype=dtype, scaling=self.precision.scaling)
            data, scale = state.get(name), state.get(f"{name}_scale")
            if (
                data is not None
                and data.dtype == dtype
                and data.device == param.device
                and _numel(scale) == scales
            ):
                continue
            values = None if data is None else dequantize(data, scale).to(param.device)
            self._set_moment(param, state, name, values)
        return state

    def _set_moment(self, param, state: dict, name: str, values: torch.Tensor | None) -> None:
        dtype = self.precision.dtype(name)
        scales = scale_numel(param.numel(), dtype=dtype, scaling=self.precision.scaling)
        state[name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
        state.pop(f"{name}_scale", None)
        scale = None
        if scales:
            scale = state[f"{name}_scale"] = torch.zeros(
                scales, dtype=torch.float32, device=param.device
            )
        if values is not None:
            quantize_(values.view(param.shape), state[name], scale)

    def _group_of(self, param: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(p is param for p in g["params"]))

    def logical_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fp32 values of the param's moments (new tensors), whatever their dtype."""
        state = self.state_of(param)
        return {name: dequantize(state[name], state.get(f"{name}_scale")) for name in MOMENTS}

    def set_logical_state(self, param: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Set the param's moments from fp32 values, rounded into this optimizer's dtypes."""
        state = self.state_of(param)
        for name, value in values.items():
            self._set_moment(param, state, name, value.to(param.device, torch.float32))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved with any moment dtypes, converting into this one's."""
        saved_groups = state_dict["param_groups"]  # read first, as torch's own load does
        saved = state_dict["state"]
        moments = {
            key: {n: dequantize(entry[n], entry.get(f"{n}_scale")) for n in MOMENTS if n in entry}
            for key, entry in saved.items()
        }
        others = {
            key: {k: v for k, v in entry.items() if k not in MOMENTS and not k.endswith("_scale")}
            for key, entry in saved.items()
        }
        super().load_state_dict({**state_dict, "state": others})
        self._host_steps.clear()  # re-read from the loaded step tensors
        params = {
            key: param
            for saved_group, group in zip(saved_groups, self.param_groups)
            for key, param in zip(saved_group["params"], group["params"])
        }
        with torch.no_grad():
            for key, values in moments.items():
                param, state = params[key], self.state[params[key]]
                for name, value in values.items():
                    self._set_moment(param, state, name, value.to(param.device))
            for group in self.param_groups:
                # A step saved on another device (an offloaded part's host, or the GPU): where
                # this optimizer keeps it (the fused step on the param's device, else the CPU).
                for param in group["params"]:
                    step = self.state[param].get("step")
                    device = param.device if group.get("fused") else torch.device("cpu")
                    if step is not None and step.device != device:
                        self.state[param]["step"] = step.to(device)

    def _host_step(self, param: torch.Tensor, state: dict) -> int:
        """The step count on the host (bias corrections need it), read from the device once."""
        host = self._host_steps.get(param)
        if host is None:
            host = int(state["step"].item())
        return host

    @staticmethod
    @torch.no_grad()
    def _measure_amaxes(targets: dict[torch.Tensor, torch.Tensor | AmaxCells]) -> None:
        for param, amax in targets.items():
            if param.numel() == 0:
                continue
            if isinstance(amax, AmaxCells):
                amax.measure_(param.detach().reshape(-1))
                continue
            # NaN is skipped, as the kernel's hardware max and the FP8 storage's rule skip it.
            torch.maximum(amax, amax_ignoring_nan(param.detach()).to(amax.dtype), out=amax)


def _numel(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel()
