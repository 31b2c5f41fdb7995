"""Megatron-FSDP for plain PyTorch users: the standalone API of `megatron_fsdp` (PyPI).

A script written against Megatron-FSDP runs with only its imports changed:

    with torch.device("meta"), quantized_model_init(enabled=True, recipe="tensorwise",
                                                     preserve_high_precision_init_val=True):
        model = MyModel()                          # nn.Linear / Fp8Linear blocks
    model = fully_shard_model(model, fsdp_unit_modules=[MyBlock], zero_dp_strategy=3,
                              init_model_with_meta_device=True)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in data:
        loss_fn(model(batch)).backward()
        optimizer.step()
        optimizer.zero_grad()

Same names, argument order and defaults as megatron_fsdp's `fully_shard_model`,
`fully_shard_optimizer`, `fully_shard` and `MixedPrecisionPolicy`. Where ours differs:
- `device_mesh` / `dp_shard_dim` / `dp_outer_dim`: HSDP needs no `hybrid_fsdp_group` (the full
  DP group is cut from the mesh; a given one is ignored). A `tp_dim` of size > 1 needs the
  module built from our tensor-parallel layers (`megatron.core.tensor_parallel`) on that
  dimension's group: each rank's TP shards are sharded over its DP dimensions (build the mesh
  with `build_data_parallel_mesh(tensor_parallel_size=...)`). Without a mesh, `process_group`
  (ours) or WORLD is sharded over.
- Meta-device init: each module's `reset_parameters()` re-runs on a real copy seeded by the
  module's name, so values do not depend on the rank or world size; Fp8Linear (no
  reset_parameters) is initialized as nn.Linear is. Ours also takes `init_fn(name, tensor)`.
- `MixedPrecisionPolicy(main_grads_dtype=None)` accumulates fp32 grads (megatron_fsdp: the
  compute dtype); main params must be fp32.
- `sync_model_each_microbatch=False` defers every deferrable reduction (no_shard/optim grads,
  HSDP's replica reduction) to `optimizer.step()`.
- Megatron-FSDP's buffer/NCCL tuning options (`nccl_ub`, `fsdp_double_buffer`, ...) are
  accepted at their defaults only.
The previous forms stay: `fully_shard_optimizer(model, {"lr": ...})` builds our distributed
optimizer (clipping, skip on NaN, checkpoints) from an OptimizerConfig or its fields.
"""

from __future__ import annotations

import copy
import importlib
import math
import types
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.distributed_optimizer import (
    FsdpDistributedOptimizer,
    ShardPiece,
)
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.param_and_grad_buffer import InitFn
from megatron.core.fp8.engine_interface import Fp8Config, Fp8Linear
from megatron.core.fp8.engine_interface import (
    quantized_model_init as quantized_model_init,  # re-export
)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.layers import TENSOR_PARALLEL_MODULES, TensorParallel

# ZeRO stage number -> Megatron-FSDP strategy name.
_ZERO_STAGES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}
# Megatron-FSDP options about its own buffers and NCCL, with their defaults: accepted unchanged.
_MEGATRON_ONLY_DEFAULTS = {
    "expt_device_mesh": None,
    "hybrid_fsdp_expt_group": None,
    "fsdp_group_ag": None,
    "expt_fsdp_group_ag": None,
    "preproc_state_dict_for_dcp_ckpt": True,
    "report_nan_in_param_grad": False,
    "average_in_collective": False,
    "disable_bucketing": False,
    "calculate_per_token_loss": False,
    "keep_fp8_transpose_cache": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
    "fsdp_db_use_persist_buf_on_alloc_fail": False,
    "disable_symmetric_registration": False,
    "enable_fine_grained_param_gather": False,
    "use_decoupled_grad": False,
    "cuda_graph_mode": False,
    "maxpool_double_buffer": False,
}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Megatron-FSDP's mixed-precision settings (same fields and defaults)."""

    main_params_dtype: torch.dtype | None = torch.float32
    """Optimizer/checkpoint params; fp32 (None: the compute dtype, accepted for fp32 models)."""
    main_grads_dtype: torch.dtype | None = None
    """Grad accumulation dtype; None: fp32 here."""
    grad_comm_dtype: torch.dtype | None = None
    """Reduce-scatter dtype; None: main_grads_dtype. bf16 = our grad_reduce_in_bf16."""


def _strategy(value: int | str, *, allowed: dict[int, str], what: str) -> str:
    if isinstance(value, int) and value in allowed:
        return allowed[value]
    if value in allowed.values():
        return value
    raise ValueError(f"{what}={value!r}: use one of {sorted(allowed)} or {list(allowed.values())}")


def _unit_classes(units: Sequence[type | str] | None, module: nn.Module) -> tuple[type, ...]:
    """Classes, or import paths like "torch.nn.TransformerEncoderLayer"."""
    if units is None:
        return tuple(getattr(module, "fsdp_unit_modules", ()) or ())
    classes = []
    for unit in units:
        if isinstance(unit, str):
            module_path, _, name = unit.rpartition(".")
            unit = getattr(importlib.import_module(module_path), name)
        classes.append(unit)
    return tuple(classes)


def _fresh_parameters(owner: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """High-precision initial values of `owner`'s own parameters, on `device`."""
    if isinstance(owner, Fp8Linear):  # as nn.Linear.reset_parameters
        dtype = torch.float32 if owner.bias is None else owner.bias.dtype
        weight = torch.empty(owner.out_features, owner.in_features, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        values = {"weight": weight}
        if owner.bias is not None:
            bound = 1.0 / math.sqrt(owner.in_features)
            values["bias"] = torch.empty_like(owner.bias, device=device).uniform_(-bound, bound)
        return values
    reset = getattr(owner, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"init_model_with_meta_device: {type(owner).__name__} has no reset_parameters(); "
            "implement it or pass init_fn=lambda name, tensor: ..."
        )
    clone = copy.deepcopy(owner).to_empty(device=device)
    clone.reset_parameters()
    return {name: param.detach() for name, param in clone.named_parameters(recurse=False)}


def reset_parameters_init_fn(root: nn.Module, device: torch.device) -> InitFn:
    """An init_fn running each owner module's reset_parameters() under a seed from its name."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def init(name: str, tensor: torch.Tensor) -> None:
        owner_path, _, attr = name.rpartition(".")
        if owner_path not in cache:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(owner_path.encode()))
                owner = root.get_submodule(owner_path) if owner_path else root
                cache[owner_path] = _fresh_parameters(owner, device)
        values = cache[owner_path]
        with torch.no_grad():
            tensor.copy_(values.pop(attr))
        if not values:
            del cache[owner_path]

    return init


def _fsdp_config_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """The FsdpConfig fields among `options`; every other option must be a Megatron-FSDP
    option left at its default."""
    fsdp_fields = {f.name for f in fields(FsdpConfig)}
    for key, value in options.items():
        if key in fsdp_fields:
            continue
        if key not in _MEGATRON_ONLY_DEFAULTS:
            raise TypeError(f"fully_shard_model: unknown option {key!r}")
        if value != _MEGATRON_ONLY_DEFAULTS[key]:
            raise ValueError(
                f"fully_shard_model: {key}={value!r} is not supported here; leave it at "
                f"{_MEGATRON_ONLY_DEFAULTS[key]!r}"
            )
    return {k: v for k, v in options.items() if k in fsdp_fields}


def _grad_dtypes(policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """(main grads dtype, grad communication dtype) of a policy, checked."""
    if policy.main_params_dtype not in (None, torch.float32):
        raise ValueError("MixedPrecisionPolicy.main_params_dtype: only torch.float32 (or None)")
    main_grads = policy.main_grads_dtype or torch.float32
    comm = policy.grad_comm_dtype or main_grads
    if comm not in (main_grads, torch.bfloat16):
        raise ValueError("MixedPrecisionPolicy.grad_comm_dtype: None, main_grads_dtype or bf16")
    return main_grads, comm


def _mesh_tensor_parallel(
    module: nn.Module, mesh: DeviceMesh | None, tp_dim: str | None
) -> TensorParallel | None:
    """The mesh's tensor-parallel group when `tp_dim` has size > 1; the module must be built
    from our TP layers (megatron.core.tensor_parallel) on that very group."""
    if tp_dim is None or mesh is None or mesh[tp_dim].size() == 1:
        return None
    group = mesh.get_group(tp_dim)
    layers = [m for m in module.modules() if isinstance(m, TENSOR_PARALLEL_MODULES)]
    ranks = dist.get_process_group_ranks(group)
    if not layers or any(dist.get_process_group_ranks(m.tp.group) != ranks for m in layers):
        raise ValueError(
            f"fully_shard_model: tp_dim {tp_dim!r} has size {mesh[tp_dim].size()}; build the "
            "module from megatron.core.tensor_parallel layers on mesh.get_group(tp_dim)"
        )
    return TensorParallel(group)


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[type | str] | None = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    *,
    process_group: dist.ProcessGroup | None = None,
    init_fn: InitFn | None = None,
    fp8_config: Fp8Config | None = None,
    **options: Any,
) -> FullyShardedDataParallel:
    """Wrap `module`; each `fsdp_unit_modules` instance is one gather/reduce unit (default:
    the module's `fsdp_unit_modules` attribute, else none: everything is one unit). Other
    keyword options are FsdpConfig fields, or Megatron-FSDP options at their defaults."""
    overrides = _fsdp_config_overrides(options)
    tensor_parallel = _mesh_tensor_parallel(module, device_mesh, tp_dim)
    main_grads, comm = _grad_dtypes(mixed_precision_policy)
    config = FsdpConfig(
        data_parallel_sharding_strategy=_strategy(
            zero_dp_strategy, allowed=_ZERO_STAGES, what="zero_dp_strategy"
        ),
        outer_dp_sharding_strategy=_strategy(
            outer_dp_sharding_strategy,
            allowed={0: "no_shard", 1: "optim"},
            what="outer_dp_sharding_strategy",
        ),
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        main_grads_dtype=main_grads,
        grad_reduce_in_bf16=comm == torch.bfloat16 and main_grads != torch.bfloat16,
        init_model_with_meta_device=init_model_with_meta_device,
        **overrides,
    )
    target = torch.device(device) if device is not None else None
    if init_fn is None and any(p.is_meta for p in module.parameters()):
        init_device = target or (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        init_fn = reset_parameters_init_fn(module, init_device)
    model = FullyShardedDataParallel(
        module,
        fsdp_config=config,
        process_group=process_group,
        device=target,
        fsdp_unit_modules=_unit_classes(fsdp_unit_modules, module),
        init_fn=init_fn,
        fp8_config=fp8_config,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tensor_parallel=tensor_parallel,
    )
    model.engine.sync_enabled = sync_model_each_microbatch
    for param in model.parameters():
        param._megatron_fsdp_model = model  # how fully_shard_optimizer finds the engine
    return model


def _shard_torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Point `optimizer` (built over a fully_shard_model's parameters) at this rank's fp32
    main-param pieces, in place, and make step()/zero_grad() run the engine around it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = {getattr(p, "_megatron_fsdp_model", None) for p in params}
    if len(owners) != 1 or None in owners:
        raise ValueError(
            "fully_shard_optimizer: build the optimizer over fully_shard_model(...).parameters() "
            "of one model (e.g. torch.optim.AdamW(model.parameters(), lr=...))"
        )
    model = owners.pop()
    engine = model.engine
    pieces_by_name: dict[str, list[ShardPiece]] = {}
    for group in engine.buffer.all_groups():
        group.ensure_grad_buffer()
        for piece in group.optimizer_pieces():
            main = group.main_shard[piece.shard_start : piece.shard_start + piece.numel]
            shard_piece = ShardPiece(piece.slot.name, piece, group, main)
            pieces_by_name.setdefault(piece.slot.name, []).append(shard_piece)
    all_pieces: list[ShardPiece] = []
    for param_group in optimizer.param_groups:
        mains = []
        for param in param_group["params"]:
            for shard_piece in pieces_by_name.get(engine.buffer.param_names[param][0], []):
                mains.append(shard_piece.main)
                all_pieces.append(shard_piece)
        param_group["params"] = mains
    optimizer.state.clear()
    torch_step = optimizer.step

    tp_grads = model.tensor_parallel_grads

    def step(self, closure=None):
        engine.finish_grad_sync()
        for shard_piece in all_pieces:
            shard_piece.main.grad = shard_piece.grad_view().to(shard_piece.main.dtype)
        if tp_grads is not None:  # sequence-parallel norms: partial grads summed over TP
            tp_grads.sum_partial_grads_(
                [p.main.grad for p in all_pieces if p.name in tp_grads.partial_names]
            )
        result = torch_step(closure)
        for shard_piece in all_pieces:
            shard_piece.main.grad = None
        engine.buffer.gather_outer_main_shards(stats=engine.stats)
        engine.buffer.write_back_main_params(stats=engine.stats)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine.zero_grad_buffer()

    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    return optimizer


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer | FullyShardedDataParallel,
    optimizer_config_or_kwargs: OptimizerConfig | dict[str, Any] | None = None,
    preproc_state_dict_for_dcp_ckpt: bool = True,
) -> torch.optim.Optimizer | FsdpDistributedOptimizer:
    """Megatron-FSDP's form: any torch.optim.Optimizer built over a fully_shard_model's
    parameters, modified in place so that backward(); step(); zero_grad() trains the sharded
    fp32 main params. Ours: (model, OptimizerConfig or its fields as a dict) builds the
    distributed optimizer (clip_grad, skip on NaN/Inf, sharded checkpoints)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _shard_torch_optimizer(optimizer)
    config = optimizer_config_or_kwargs
    if isinstance(config, dict):
        known = {f.name for f in fields(OptimizerConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"fully_shard_optimizer: unknown options {unknown}; use {sorted(known)}"
            )
        config = OptimizerConfig(**config)
    if config is None:
        raise ValueError("fully_shard_optimizer(model, config): pass an OptimizerConfig or dict")
    return optimizer.build_optimizer(config)


def fully_shard(
    module: nn.Module, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    """fully_shard_model(module, ...) then fully_shard_optimizer(optimizer), where `optimizer`
    was built over `module`'s parameters (they are re-pointed at the sharded ones)."""
    names = {id(p): name for name, p in module.named_parameters()}
    model = fully_shard_model(module, *args, **kwargs)
    sharded = dict(model.module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model, fully_shard_optimizer(optimizer)
