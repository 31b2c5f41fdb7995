"""FullyShardedDataParallel: the only Megatron-FSDP entry the training loop touches.

Per step (M micro-batches):

    model.zero_grad_buffer()                  # also resets comm_stats()
    for k in range(M):
        ctx = model.no_sync() if k < M - 1 else contextlib.nullcontext()
        with ctx:
            loss = model(tokens, labels=labels).mean() / M
            loss.backward()
    model.finish_grad_sync()                  # wait for every reduction
    result = optimizer.step()                 # optimizer = model.build_optimizer(cfg)
    stats = model.comm_stats()                # bytes of this step

no_sync() only defers reductions for no_shard/optim; sharded-grad strategies still
reduce-scatter every micro-batch (a rank keeps no full grads between micro-batches).

FP8 parameters (`--fp8-param-gather`): pass `fp8_config` (with fp8_param_gather=True) and every
Fp8Linear weight is kept only as FP8 bytes + fp32 main shards, whether the model was built in
high precision (converted here, main params = the exact weight values), on the meta device
(main params from init_fn), or under quantized_model_init (main params from the kept init
values; this needs no fp8_config at all). `model_init_context` is the build context to use.

Groups: `process_group` (plain ZeRO over it; default WORLD) or a `device_mesh` with the names
of its shard dimension and, for HSDP, its outer (replicate) dimension
(`megatron.core.distributed.data_parallel_mesh`). Nothing reads process groups from globals.
With tensor parallelism the mesh has a `tp` dimension too; pass `tensor_parallel` (its group):
sharded checkpoints then hold every TP-split parameter as its full tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.dist_checkpointing.flat_dtensor import ExpertPlacement
from megatron.core.distributed.data_parallel_mesh import (
    DP_SHARD_DIM,
    DataParallelGroups,
)
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.distributed_optimizer import FsdpDistributedOptimizer
from megatron.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.param_and_grad_buffer import InitFn
from megatron.core.distributed.fsdp.state_dict import (
    full_parameters,
    load_model_sharded_state_dict,
    model_sharded_state_dict,
)
from megatron.core.fp8.engine_interface import Fp8Config, quantized_model_init
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel import (
    TensorParallel,
    TensorParallelGrads,
    tensor_parallel_placement,
)
from megatron.core.transformer.transformer_layer import TransformerLayer


def default_unit_modules(module: nn.Module) -> tuple[type, ...]:
    """TransformerLayer for GPTModel; a model may also name its units itself."""
    declared = getattr(module, "fsdp_unit_modules", None)
    if declared:
        return tuple(declared)
    return (TransformerLayer,)


def resolve_groups(
    *,
    process_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh | None,
    dp_shard_dim: str | None,
    dp_outer_dim: str | None,
) -> DataParallelGroups:
    """The engine's groups from either a process group or a mesh (not both)."""
    if device_mesh is None:
        if dp_outer_dim is not None:
            raise ValueError(
                "FullyShardedDataParallel: dp_outer_dim names a dimension of device_mesh; pass "
                "device_mesh=build_data_parallel_mesh(...) with it"
            )
        return DataParallelGroups.single_group(process_group or dist.group.WORLD)
    if process_group is not None:
        raise ValueError(
            "FullyShardedDataParallel: pass process_group or device_mesh, not both (the mesh's "
            "dp_shard_dim group is the shard group)"
        )
    return DataParallelGroups.from_mesh(
        device_mesh, shard_dim=dp_shard_dim or DP_SHARD_DIM, outer_dim=dp_outer_dim
    )


class FullyShardedDataParallel(nn.Module):
    """Shards `module`'s params, grads and optimizer state over the shard group; under HSDP
    (`dp_outer_dim`) replicates that sharded state across the outer group."""

    def __init__(
        self,
        module: nn.Module,
        *,
        fsdp_config: FsdpConfig,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        fsdp_unit_modules: tuple[type, ...] | None = None,
        init_fn: InitFn | None = None,
        fp8_config: Fp8Config | None = None,
        device_mesh: DeviceMesh | None = None,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        expert_data_parallel_group: dist.ProcessGroup | None = None,
        expert_param_names: Iterable[str] = (),
        tensor_parallel: TensorParallel | None = None,
        expert_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        """expert_data_parallel_group / expert_param_names (expert parallelism): those
        parameters, which differ across the expert-parallel ranks, are sharded and reduced
        over that group (world / EP ranks) instead of every DP rank. Under HSDP it is the EDP
        ranks of this rank's replica, and expert shards are replicated and reduced across the
        replicas over the outer group like every other shard (expert_parallel.py).
        expert_parallel_group: the EP group, which places this rank's experts in the full
        [num_experts, ...] tensors of sharded checkpoints (needed to save or load with EP).

        tensor_parallel: `module` is one tensor-parallel rank's, built from our TP layers on
        that group; its local shards are sharded over the DP groups (the ranks of equal TP
        rank) and the optimizer finishes the grads over TP (`TensorParallelGrads`)."""
        super().__init__()
        self.module = module
        # Read before the engine replaces the parameters (their sequence-parallel marks).
        self.tensor_parallel_grads, tp_placement = None, None
        if tensor_parallel is not None:
            self.tensor_parallel_grads = TensorParallelGrads.of_model(module, tensor_parallel)
            tp_placement = tensor_parallel_placement(module, tensor_parallel)
        self.fsdp_config = fsdp_config
        expert_names = frozenset(expert_param_names)
        self.dp_groups = resolve_groups(
            process_group=process_group,
            device_mesh=device_mesh,
            dp_shard_dim=dp_shard_dim,
            dp_outer_dim=dp_outer_dim,
        )
        if self.dp_groups.outer is not None and not fsdp_config.shards_optimizer_state:
            raise ValueError(
                "HSDP (dp_outer_dim) needs an inner strategy that shards: use "
                "data_parallel_sharding_strategy optim_grads_params (or optim, optim_grads)"
            )
        self.process_group = self.dp_groups.shard
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        unit_types = fsdp_unit_modules or default_unit_modules(module)
        self.engine = MegatronFSDP(
            module,
            config=fsdp_config,
            groups=self.dp_groups,
            device=self.device,
            unit_types=tuple(unit_types),
            init_fn=init_fn,
            convert_fp8_linears=fp8_config is not None and fp8_config.fp8_param_gather,
            expert_group=expert_data_parallel_group,
            expert_param_names=expert_names,
            expert_placement=ExpertPlacement.of_group(expert_names, expert_parallel_group),
            tensor_parallel_placement=tp_placement,
            tensor_parallel_group=None if tensor_parallel is None else tensor_parallel.group,
        )
        self._init_meta_buffers()

    @staticmethod
    def model_init_context(
        *, fsdp_config: FsdpConfig, fp8_config: Fp8Config | None = None
    ) -> contextlib.ExitStack:
        """Where to build the model: on meta with init_model_with_meta_device, and under
        quantized_model_init with fp8_param_gather. Building in high precision and passing
        fp8_config to the constructor gives the same FP8 weights."""
        stack = contextlib.ExitStack()
        if fsdp_config.init_model_with_meta_device:
            stack.enter_context(torch.device("meta"))
        if fp8_config is not None and fp8_config.fp8_param_gather:
            stack.enter_context(
                quantized_model_init(
                    recipe=fp8_config.recipe, preserve_high_precision_init_val=True
                )
            )
        return stack

    def _init_meta_buffers(self) -> None:
        """Non-persistent buffers of a meta-built model: the model re-creates them itself."""
        if not any(buf.is_meta for buf in self.module.buffers()):
            return
        init_buffers = getattr(self.module, "init_buffers", None)
        if init_buffers is None:
            raise ValueError(
                "FullyShardedDataParallel: the model has buffers on the meta device and no "
                "init_buffers(device) method to re-create them"
            )
        init_buffers(self.device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.pre_root_forward()
        output = self.module(*args, **kwargs)
        self.engine.post_root_forward()
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Defer grad reduction (no_shard/optim) for the micro-batches run inside."""
        previous = self.engine.sync_enabled
        self.engine.sync_enabled = False
        try:
            yield
        finally:
            self.engine.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        self.engine.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        self.engine.zero_grad_buffer()

    def build_optimizer(self, optimizer_config: OptimizerConfig) -> FsdpDistributedOptimizer:
        return FsdpDistributedOptimizer(
            self.engine,
            config=optimizer_config,
            tensor_parallel_grads=self.tensor_parallel_grads,
        )

    def comm_stats(self) -> dict[str, int]:
        """Bytes all-gathered / reduce-scattered / all-reduced by this rank since the last
        zero_grad_buffer(), inner and (HSDP) outer apart (definitions in
        collectives.CommStats)."""
        return self.engine.stats.as_dict()

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes this rank holds per role: params, main_params, grads."""
        return self.engine.buffer.persistent_bytes()

    def sharded_state_dict(self, *, fp8_scaling_state: bool = True) -> dict[str, Any]:
        """fp32 main params as flat DTensor pieces (+ their shapes), for dist_checkpointing,
        plus the delayed-scaling state of every Fp8Linear when any uses that recipe
        (`fp8_delayed_scaling`). fp8_scaling_state=False leaves it out: the template for
        loading a checkpoint saved without it (a bf16 or another recipe's run). Under tensor
        parallelism each TP shard is its piece of the full tensor (TensorParallelPlacement),
        so the checkpoint loads at any TP x DP layout."""
        return model_sharded_state_dict(self.engine, fp8_scaling_state=fp8_scaling_state)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take loaded main params and re-quantize FP8 weights from them: with the loaded
        delayed-scaling state when present, else from a fresh one."""
        load_model_sharded_state_dict(self.engine, state)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 main value on every rank (collective; tests, export)."""
        return full_parameters(self.engine)
