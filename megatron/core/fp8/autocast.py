"""fp8_autocast and the delayed-scaling state (FP8_NUMERICS.md, recipe "delayed").

Each Fp8Linear owns a `DelayedScaling` with one `ScalingMeta` (scale, amax history) per
quantized tensor. Quantizing records max|x| into slot 0 and marks the meta pending; once per
direction all pending metas are flushed together (one packed MAX all-reduce over the
`Fp8Setup`'s amax group, then every scale updated and history rolled). Forward: when the
model's forward or the fp8_autocast block ends (or after the module's forward without a
setup). Backward: a callback queued on the autograd engine; reentrant checkpointing makes each
segment its own backward, so use `use_reentrant=False` to keep one collective. Recompute:
FP8_NUMERICS.md (assumes a step's backward runs before the module's next forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.formats import ROLES
from megatron.core.fp8.reference import delayed_scale_update, roll_amax_history


class ScalingMeta:
    """Delayed-scaling state of one quantized tensor: scale (0-d fp32) and amax history [L]."""

    def __init__(self, *, fp8_dtype: torch.dtype, config: Fp8Config, device=None) -> None:
        self.fp8_dtype = fp8_dtype
        self.config = config
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(config.amax_history_len, dtype=torch.float32, device=device)
        self.forward_scale: torch.Tensor | None = None

    def record(self, amax: torch.Tensor) -> None:
        """Take max with slot 0, so that several quantizations in one step keep the largest."""
        amax = amax.detach().to(self.amax_history.device, torch.float32).reshape(())
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax)

    def update(self) -> None:
        """Step 3 and 4 of the delayed recipe on the (already reduced) history."""
        self.scale = delayed_scale_update(
            self.amax_history,
            self.scale,
            fp8_dtype=self.fp8_dtype,
            margin=self.config.margin,
            amax_compute_algo=self.config.amax_compute_algo,
        )
        self.amax_history = roll_amax_history(self.amax_history)


class BackwardFlush:
    """Delayed scaling's backward flush: the grad metas whose amaxes the running backward
    records (as it quantizes the grads), per reduction group, flushed once when that backward
    ends. An Fp8Setup's modules share one; a module outside any setup its DelayedScaling's."""

    def __init__(self) -> None:
        # Keyed by id(group) so that None works too.
        self.pending: dict[int, tuple[dist.ProcessGroup | None, dict[int, ScalingMeta]]] = {}
        # Graph task (torch._C._current_graph_task_id) whose end runs the queued flush; None
        # when none is queued. A backward that raises never runs its final callbacks: keying
        # on the task lets the next backward queue its own flush instead of waiting on a
        # dead one.
        self.task: int | None = None

    def expect(self, meta: ScalingMeta, group) -> None:
        """Mark a grad meta for the next flush. Called by `record`, or before a compiled
        forward whose backward cannot run Python (`Fp8Linear.before_compiled_forward`)."""
        self.pending.setdefault(id(group), (group, {}))[1][id(meta)] = meta

    def record(self, meta: ScalingMeta, group) -> None:
        """The quantization already maxed the grad's amax into slot 0: flush once when the
        running backward pass ends."""
        self.expect(meta, group)
        self.queue()

    def queue(self) -> None:
        """From inside a backward pass: flush the pending grad metas once, when it ends."""
        task = torch._C._current_graph_task_id()
        if self.task != task:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self.task = task

    def _flush(self) -> None:
        self.task = None
        pending = list(self.pending.values())
        self.pending.clear()
        for group, metas in pending:
            reduce_and_update(list(metas.values()), group)


class DelayedScaling:
    """The delayed-scaling metas of one Fp8Linear, keyed by tensor role."""

    def __init__(self, *, config: Fp8Config, dtypes: dict[str, torch.dtype], device=None) -> None:
        self.metas = {
            role: ScalingMeta(fp8_dtype=dtypes[role], config=config, device=device)
            for role in ROLES
        }
        self.backward = BackwardFlush()  # used outside any Fp8Setup

    def move_to(self, device: torch.device) -> None:
        """Keep the state on the device of the tensors it scales (a module's .to() does not
        move it; the fused CUDA kernels read scales and write amaxes there)."""
        for meta in self.metas.values():
            if meta.scale.device != device:
                meta.scale = meta.scale.to(device)
                meta.amax_history = meta.amax_history.to(device)
                if meta.forward_scale is not None:
                    meta.forward_scale = meta.forward_scale.to(device)

    def state_dict(self) -> dict:
        """Plain tensors plus JSON-able metadata."""
        state: dict = {}
        for role, meta in self.metas.items():
            state[f"{role}.scale"] = meta.scale.detach().clone().cpu()
            state[f"{role}.amax_history"] = meta.amax_history.detach().clone().cpu()
        first = self.metas["input"].config
        state["metadata"] = dict(
            amax_history_len=first.amax_history_len,
            margin=first.margin,
            amax_compute_algo=first.amax_compute_algo,
            fp8_dtypes={role: str(m.fp8_dtype) for role, m in self.metas.items()},
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        for role, meta in self.metas.items():
            history = state[f"{role}.amax_history"]
            if history.shape != meta.amax_history.shape:
                raise ValueError(
                    f"checkpoint amax history of '{role}' has length {history.shape[0]}, this run "
                    f"uses {meta.amax_history.shape[0]}; set --fp8-amax-history-len to match"
                )
            meta.scale = state[f"{role}.scale"].to(meta.scale.device, torch.float32).clone()
            meta.amax_history = history.to(meta.amax_history.device, torch.float32).clone()


def in_recompute() -> bool:
    """True while the autograd engine runs a forward: an activation-checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def reduce_and_update(metas: list[ScalingMeta], group: dist.ProcessGroup | None) -> None:
    """One packed MAX all-reduce of every meta's slot-0 amax, then scale update + roll. Metas
    of the same format and settings update together as one [N, L] history (a fixed number of
    small kernels whatever the layer count); each meta's scale and history then view the new
    stacked tensors. Scales are replaced, never written in place, so a forward's captured scale
    stays what it used (the reduced amaxes go into slot 0 of the replaced histories: `_stacked`)."""
    if not metas:
        return
    groups: dict[tuple, list[ScalingMeta]] = {}
    for meta in metas:
        key = (
            meta.fp8_dtype,
            meta.config.margin,
            meta.config.amax_compute_algo,
            meta.amax_history.shape[0],
            meta.amax_history.device,
        )
        groups.setdefault(key, []).append(meta)
    ordered = [meta for members in groups.values() for meta in members]
    reduce = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    packed = None
    if reduce:
        packed = torch.stack([meta.amax_history[0] for meta in ordered])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    start = 0
    for members in groups.values():
        first = members[0]
        histories = _stacked(
            [meta.amax_history for meta in members], shape=first.amax_history.shape
        )
        if packed is not None:
            histories[:, 0] = packed[start : start + len(members)].to(histories.device)
        start += len(members)
        settings = dict(
            fp8_dtype=first.fp8_dtype,
            margin=first.config.margin,
            amax_compute_algo=first.config.amax_compute_algo,
        )
        old_scales = _stacked([meta.scale for meta in members], shape=())
        fused = _fused_delayed_update(histories, old_scales, settings)
        if fused is not None:
            scales, rolled = fused
        else:
            scales = delayed_scale_update(histories, old_scales, **settings)
            rolled = roll_amax_history(histories)
        for meta, scale, history in zip(members, scales.unbind(0), rolled.unbind(0), strict=True):
            meta.scale, meta.amax_history = scale, history


def _stacked(tensors: list[torch.Tensor], *, shape: tuple) -> torch.Tensor:
    """torch.stack of the tensors (each reshaped to `shape`), or, with no copy, the tensor whose
    rows they are in order (the last flush of the same metas left `unbind` views of it)."""
    base, rows = _rows_of(tensors, shape=shape)
    if base is not None and rows == list(range(base.shape[0])):
        return base
    return torch.stack([t.reshape(shape) for t in tensors])


def _rows_of(tensors: list[torch.Tensor], *, shape: tuple) -> tuple[torch.Tensor | None, list]:
    """The contiguous tensor whose rows the tensors are, and their row indices; (None, [])
    if they are not all rows of one tensor."""
    base = tensors[0]._base
    if base is None or tuple(base.shape[1:]) != shape or not base.is_contiguous():
        return None, []
    offset, stride = base.storage_offset(), max(base.stride(0), 1)
    rows = [(t.storage_offset() - offset) // stride for t in tensors]
    whole = all(t._base is base and t.shape == shape and t.is_contiguous() for t in tensors)
    if whole and all(t.storage_offset() == offset + r * stride for t, r in zip(tensors, rows)):
        return base, rows
    return None, []


def record_amaxes(metas: list[ScalingMeta], amaxes: torch.Tensor) -> None:
    """`meta.record(amax)` for each meta and the amax of the same index: one maximum over a
    slice of slot 0 where the histories are consecutive rows of one tensor (as a flush of these
    metas in order leaves them), else one record per meta (no index: it would wait on a GPU)."""
    if not metas:
        return
    histories = [meta.amax_history for meta in metas]
    base, rows = _rows_of(histories, shape=histories[0].shape)
    if base is None or rows != list(range(rows[0], rows[0] + len(rows))):
        for meta, amax in zip(metas, amaxes.unbind(0), strict=True):
            meta.record(amax)
        return
    amaxes = amaxes.detach().to(base.device, torch.float32).reshape(len(metas))
    slot0 = base[rows[0] : rows[0] + len(rows), 0]
    slot0.copy_(torch.maximum(slot0, amaxes))


def _fused_delayed_update(histories, scales, settings):
    """The one-kernel CUDA update (megatron.core.fp8.cuda), or None (CPU, no Triton)."""
    if not histories.is_cuda:
        return None
    try:
        from megatron.core.fp8.cuda.quantize_per_tensor import delayed_update
    except ImportError:
        return None
    return delayed_update(histories, scales, **settings)


@dataclass
class Fp8Setup:
    """What a model's Fp8Linears run with, the one source of their settings: given once at
    model setup (`linear.apply_fp8_setup`, the seam in `training/model_setup.py`) or for a
    block by `fp8_autocast`: whether FP8 runs, the recipe settings (None: each module's own)
    and the group whose ranks share delayed-scaling amaxes. Delayed scaling's forward amaxes
    wait in `pending` until the model's forward (or the block) ends, then `flush` reduces them
    in one packed all-reduce; its grad amaxes wait in `backward`."""

    fp8_config: Fp8Config | None
    group: dist.ProcessGroup | None
    enabled: bool = True
    pending: dict[int, ScalingMeta] = field(default_factory=dict)
    backward: BackwardFlush = field(default_factory=BackwardFlush)

    def flush(self) -> None:
        metas = list(self.pending.values())
        self.pending.clear()
        reduce_and_update(metas, self.group)


def forward_recorded(meta: ScalingMeta, setup: Fp8Setup | None = None) -> None:
    """The quantization already maxed this forward's amax into slot 0: schedule the flush at
    the end of the model's forward or fp8_autocast block (`setup`), else flush now."""
    if setup is not None:
        setup.pending[id(meta)] = meta
    else:
        reduce_and_update([meta], None)


@contextlib.contextmanager
def fp8_autocast(
    model: nn.Module,
    enabled: bool = True,
    *,
    fp8_config: Fp8Config | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
) -> Iterator[Fp8Setup]:
    """Run `model`'s Fp8Linears inside in FP8 (enabled) or high precision: sets what
    `apply_fp8_setup` sets for the block, restores it at exit, then flushes delayed scaling's
    forward amaxes (one packed MAX all-reduce over `amax_reduction_group`). fp8_config replaces
    each module's config (its recipe must match FP8 weights). A recompute runs with the settings
    in force when it runs.
    """
    setup = Fp8Setup(fp8_config=fp8_config, group=amax_reduction_group, enabled=enabled)
    owners = [module for module in model.modules() if hasattr(module, "fp8_setup")]
    previous = [module.fp8_setup for module in owners]
    for module in owners:
        module.fp8_setup = setup
    try:
        yield setup
    finally:
        for module, before in zip(owners, previous, strict=True):
            module.fp8_setup = before
        setup.flush()


def _owners(model: nn.Module) -> dict[str, nn.Module]:
    """The modules with delayed-scaling state, by name."""
    return {name: m for name, m in model.named_modules() if getattr(m, "delayed_scaling", None)}


def delayed_scaling_state_dict(model: nn.Module) -> dict:
    """Every Fp8Linear's delayed-scaling state, keyed by its module name (stable across runs)."""
    return {name: module.delayed_scaling.state_dict() for name, module in _owners(model).items()}


def load_delayed_scaling_state_dict(model: nn.Module, state: dict, *, strict: bool = True) -> None:
    """Load what `delayed_scaling_state_dict` returned; strict: module names must match."""
    owners = _owners(model)
    if strict and set(owners) != set(state):
        missing, unexpected = sorted(set(owners) - set(state)), sorted(set(state) - set(owners))
        raise KeyError(
            f"FP8 delayed-scaling state does not match the model: missing {missing}, "
            f"unexpected {unexpected}; load a checkpoint of the same architecture or strict=False"
        )
    for name, module in owners.items():
        if name in state:
            module.delayed_scaling.load_state_dict(state[name])
