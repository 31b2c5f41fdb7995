"""Optimizer CPU offload (`--optimizer-cpu-offload --optimizer-offload-fraction F`): a FusedAdamW
whose leading params keep their optimizer state and their update on the host.

The split is by whole params, in order: the host takes the prefix of the params that holds
about F of their elements (`offload_count`), so that for the engine's main shard, whose pieces
lie end to end, the offloaded part is one contiguous range. Each offloaded param has a host
copy (the host update's param, fp32 or the param's dtype) and a host grad buffer, in pinned
memory on CUDA. One step:

1. the offloaded params' grads start copying to the host on a side stream;
2. the device part runs its (Triton) update on the compute stream meanwhile;
3. once the grads have arrived the host runs its update (torch, on the CPU) while the GPU works;
4. the updated host params go back on the side stream, and the compute stream waits for them
   before anything reads the params again.

The state dict is FusedAdamW's format over all params in the caller's order, so a checkpoint
resumes at any offload fraction, and with other moment dtypes.
"""

from __future__ import annotations

import torch

from megatron.core.optimizer.fused_adamw import FusedAdamW

HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")
"""What the LR scheduler and the config set on a param group, copied to the two parts."""


def offload_count(numels: list[int], fraction: float) -> int:
    """How many leading params go to the host: a param goes while the elements before it plus
    half its own are at most `fraction` of all (0 keeps all on the device, 1 moves all)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction {fraction}: give a value in [0, 1]")
    target, before = fraction * sum(numels), 0
    for index, numel in enumerate(numels):
        if before + numel / 2 > target:
            return index
        before += numel
    return len(numels)


class OffloadedAdamW:
    """FusedAdamW over `groups` with the leading `offload_fraction` of their elements updated
    on the CPU. Takes FusedAdamW's keyword arguments; `param_groups` are the caller's groups
    (the LR scheduler sets them), `amax_targets` and `grad_scale` work as FusedAdamW's."""

    def __init__(self, groups: list[dict], *, offload_fraction: float, **adamw_options) -> None:
        self.param_groups = [dict(group, params=list(group["params"])) for group in groups]
        params = [p for group in self.param_groups for p in group["params"]]
        count = offload_count([p.numel() for p in params], offload_fraction)
        self.offloaded = params[:count]
        """The device params whose state and update live on the host."""
        on_host = self._on_host = {id(p) for p in self.offloaded}
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.offloaded)
        self.host_params = [p.detach().to("cpu", copy=True) for p in self.offloaded]
        if pin:
            self.host_params = [h.pin_memory() for h in self.host_params]
        host_of = dict(zip(map(id, self.offloaded), self.host_params))
        device_groups, host_groups = [], []
        for group in self.param_groups:
            common = {k: v for k, v in group.items() if k != "params"}
            kept = [p for p in group["params"] if id(p) not in on_host]
            moved = [host_of[id(p)] for p in group["params"] if id(p) in on_host]
            device_groups.append(dict(common, params=kept))
            host_groups.append(dict(common, params=moved))
        host_kwargs = {k: v for k, v in adamw_options.items() if k not in ("fused", "foreach")}
        self.device = _part(device_groups, adamw_options)
        self.host = _part(host_groups, dict(host_kwargs, foreach=False))
        for group in self.param_groups:
            group["fused"] = self.device is not None and bool(adamw_options.get("fused"))
        self.amax_targets: dict[torch.Tensor, torch.Tensor] = {}
        self._copy_stream = torch.cuda.Stream() if pin else None

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        """Every param's state, keyed by the caller's params (host states for offloaded ones);
        a param without state gets an empty one in its part on first access, as torch's
        optimizer state (a defaultdict) does, so writes into it reach the part."""
        host_of = dict(zip(map(id, self.offloaded), self.host_params))
        merged = _StateView(lambda p: self._part_state(p, host_of))
        for param, host in zip(self.offloaded, self.host_params):
            if host in self.host.state:
                merged[param] = self.host.state[host]
        if self.device is not None:
            merged.update(self.device.state)
        return merged

    def _part_state(self, param: torch.Tensor, host_of: dict[int, torch.Tensor]) -> dict:
        host = host_of.get(id(param))
        return self.host.state[host] if host is not None else self.device.state[param]

    def init_state(self) -> None:
        for part in (self.device, self.host):
            if part is not None:
                part.init_state()

    def _owner(self, param: torch.Tensor) -> tuple[FusedAdamW, torch.Tensor]:
        """The part that updates `param`, and the param as that part knows it."""
        for offloaded, host in zip(self.offloaded, self.host_params):
            if offloaded is param:
                return self.host, host
        return self.device, param

    def logical_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """FusedAdamW.logical_state of the param, from its part (host values when offloaded)."""
        part, own = self._owner(param)
        return part.logical_state(own)

    def set_logical_state(self, param: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        part, own = self._owner(param)
        part.set_logical_state(own, values)

    def _sync_hyperparameters(self) -> None:
        for part in (self.device, self.host):
            if part is None:
                continue
            for group, inner in zip(self.param_groups, part.param_groups):
                inner.update({key: group[key] for key in HYPERPARAMETERS if key in group})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        self._sync_hyperparameters()
        grad_scale = getattr(self, "grad_scale", None)
        arrived = self._grads_to_host()
        if self.device is not None:
            if grad_scale is not None:
                self.device.grad_scale = grad_scale
            self.device.amax_targets = {
                p: amax for p, amax in self.amax_targets.items() if id(p) not in self._on_host
            }
            try:
                self.device.step()
            finally:
                self.device.__dict__.pop("grad_scale", None)
                self.device.amax_targets = {}
        if self.host is not None:
            if arrived is not None:
                arrived.synchronize()
            if grad_scale is not None:
                # The division the fused kernels make as they read a grad, done on the host
                # grads (torch's CPU AdamW step takes no grad_scale).
                host_scale = grad_scale.to("cpu")
                for host in self.host_params:
                    if host.grad is not None:
                        host.grad.div_(host_scale)
            self.host.step()
            self._params_to_device()
        FusedAdamW._measure_amaxes(
            {p: self.amax_targets[p] for p in self.offloaded if p in self.amax_targets}
        )

    def _grads_to_host(self) -> torch.cuda.Event | None:
        """Start the offloaded grads' copies (side stream on CUDA); the event marks arrival."""
        pairs = []
        for param, host in zip(self.offloaded, self.host_params):
            if param.grad is None:
                host.grad = None
                continue
            if host.grad is None or host.grad.dtype != param.grad.dtype:
                pinned = self._copy_stream is not None
                host.grad = torch.empty(host.shape, dtype=param.grad.dtype, pin_memory=pinned)
            pairs.append((host.grad, param.grad))
        if self._copy_stream is None:
            for host_grad, grad in pairs:
                host_grad.copy_(grad)
            return None
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            for host_grad, grad in pairs:
                host_grad.copy_(grad, non_blocking=True)
                grad.record_stream(self._copy_stream)
            return self._copy_stream.record_event()

    def _params_to_device(self) -> None:
        if self._copy_stream is None:
            for param, host in zip(self.offloaded, self.host_params):
                param.copy_(host)
            return
        with torch.cuda.stream(self._copy_stream):
            for param, host in zip(self.offloaded, self.host_params):
                param.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(self._copy_stream)

    def state_dict(self) -> dict:
        """FusedAdamW's state dict over all params in the caller's order."""
        states: dict[int, dict] = {}
        index_of = _indices(self.param_groups)
        for part, keys in self._parts():
            saved = part.state_dict()
            for inner_index, param in zip(_flat_indices(saved), keys):
                if inner_index in saved["state"]:
                    states[index_of[id(param)]] = saved["state"][inner_index]
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index_of[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {"state": states, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        index_of = _indices(self.param_groups)
        for part, keys in self._parts():
            inner = part.state_dict()
            inner_index = dict(zip(map(id, keys), _flat_indices(inner)))
            inner["state"] = {
                inner_index[id(p)]: state_dict["state"][index_of[id(p)]]
                for p in keys
                if index_of[id(p)] in state_dict["state"]
            }
            for inner_group, group in zip(inner["param_groups"], state_dict["param_groups"]):
                inner_group.update({k: v for k, v in group.items() if k in HYPERPARAMETERS})
            part.load_state_dict(inner)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in HYPERPARAMETERS})
        self.refresh_host_params()

    @torch.no_grad()
    def refresh_host_params(self) -> None:
        """Copy the offloaded params into their host copies: call after anything but the step
        changed the params (a checkpoint load of the main params)."""
        for param, host in zip(self.offloaded, self.host_params):
            host.copy_(param.detach())

    def _parts(self) -> list[tuple[FusedAdamW, list[torch.Tensor]]]:
        """Each part with the caller's params it updates, in its own param order."""
        parts = []
        offloaded = {id(p) for p in self.offloaded}
        if self.device is not None:
            kept = [p for g in self.param_groups for p in g["params"] if id(p) not in offloaded]
            parts.append((self.device, kept))
        if self.host is not None:
            moved = [p for g in self.param_groups for p in g["params"] if id(p) in offloaded]
            parts.append((self.host, moved))
        return parts


class _StateView(dict):
    """A dict of the parts' states that fetches (creating) a missing param's from its part."""

    def __init__(self, fetch) -> None:
        super().__init__()
        self._fetch = fetch

    def __missing__(self, param: torch.Tensor) -> dict:
        value = self[param] = self._fetch(param)
        return value


def _part(groups: list[dict], kwargs: dict) -> FusedAdamW | None:
    if not any(group["params"] for group in groups):
        return None
    return FusedAdamW(groups, **kwargs)


def _indices(groups: list[dict]) -> dict[int, int]:
    """torch's state-dict numbering: params counted through the groups in order."""
    return {id(p): index for index, p in enumerate(p for g in groups for p in g["params"])}


def _flat_indices(saved: dict) -> list[int]:
    return [index for group in saved["param_groups"] for index in group["params"]]
