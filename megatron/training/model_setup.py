"""Builds the model and its optimizer for the chosen data-parallel engine.

This is the one place that decides how the plain GPTModel is wrapped: torch DDP (replicated),
or Megatron-FSDP through its adapter. The training loop only sees ModelAndOptimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.data_parallel_mesh import DP_OUTER_DIM, DP_SHARD_DIM
from megatron.core.distributed.expert_parallel import reduce_expert_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.linear import apply_fp8_setup
from megatron.core.models.gpt import GPTModel, count_parameters, num_floating_point_operations
from megatron.core.optimizer import MegatronOptimizer, MixedPrecisionOptimizer
from megatron.core.optimizer.grad_scaler import GradScaler
from megatron.core.tensor_parallel import (
    TensorParallelGrads,
    all_reduce_sequence_parallel_grads,
    tensor_parallel_placement,
    tensor_parallel_shards,
)
from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.moe.moe_layer import local_expert_rows
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flags.run_config import ModelSetupConfig
from megatron.training.initialize import DistributedEnv
from megatron.training.run_hooks import build_grad_scaler


@dataclass
class ModelAndOptimizer:
    model: nn.Module
    """What forward is called on: the wrapped model (DDP or Megatron-FSDP) or the plain one."""
    module: GPTModel
    """The plain GPTModel underneath."""
    optimizer: MegatronOptimizer
    config: TransformerConfig
    flops_per_iteration: float
    num_parameters: int
    grad_scaler: GradScaler | None = None
    """--fp16: the loss scale backward runs at (None: no scaling)."""
    last_step: dict = field(default_factory=dict)
    """What the last train_step measured beyond its return value (timings, zero-grad count)."""
    expert_grad_sync: Callable[[], None] | None = None
    """DDP with --expert-model-parallel-size > 1: reduces the routed-expert grads over the
    expert-data-parallel group (DDP itself reduces the dense ones over every rank)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip cross-rank grad reduction for a non-final micro-batch, where the engine can."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        finish = getattr(self.model, "finish_grad_sync", None)
        if finish is not None:
            finish()
        if self.expert_grad_sync is not None:
            self.expert_grad_sync()
        tensor_parallel = self.module.tensor_parallel
        if tensor_parallel is not None and tensor_parallel.sequence_parallel:
            # Norms and row-parallel biases saw only this rank's sequence shard.
            all_reduce_sequence_parallel_grads(self.module, tensor_parallel.group)


def apply_model_setup(
    module: GPTModel,
    config: TransformerConfig,
    *,
    setup: ModelSetupConfig,
    env: DistributedEnv,
    shard: Callable[[GPTModel], tuple[nn.Module, MegatronOptimizer]],
) -> tuple[nn.Module, MegatronOptimizer]:
    """The model-setup seam, the same for every engine and in this order:
    1. FP8: the model's Fp8Linears (built by the Linear factory) run with the recipe settings
       and share delayed-scaling amaxes over the data-parallel group, given here once rather
       than by an fp8_autocast around every call;
    2. activation recompute: TransformerConfig's recompute settings, read by the block at
       forward time, so nothing is applied here;
    3. compile (--torch-compile): `compile_layers`;
    4. sharding: `shard` wraps the module for its engine and builds the optimizer, returning
       (what forward is called on, the optimizer)."""
    if config.fp8 is not None:
        apply_fp8_setup(
            module,
            fp8_config=config.fp8,
            # Delayed histories agree over DP and TP (a TP shard's input is the whole input's).
            amax_reduction_group=env.dp_group if env.tensor_parallel is None else dist.group.WORLD,
            expert_amax_reduction_group=env.expert_groups.expert_dp,
        )
    if setup.torch_compile:
        compile_layers(module)
    return shard(module)


def compile_layers(module: GPTModel) -> None:
    """Regional compile: each transformer layer's forward goes through torch.compile, the
    multi-token prediction depths' transformer layers too (FSDP units like the decoder's), and
    the per-token cross-entropy (its fp32 upcast fused into the softmax).

    Only `forward` is compiled, not the module call, so the FSDP engine's forward hooks (its
    gathers and releases) run eagerly around the compiled region. Every layer runs the same
    code object and its parameters are graph inputs (dynamo inlines nn.Modules), so identical
    layers share one compiled graph instead of compiling once each. This is the third step of
    the model-setup seam (`apply_model_setup`).
    """
    layers = list(module.decoder.layers)
    if module.mtp is not None:
        layers += [depth.transformer_layer for depth in module.mtp.layers]
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
        # FP8-parameter Linears run inside the graph through their weights' stand-ins.
        prepare_for_compile(layer)
    compile_loss(module)


def compile_loss(module: GPTModel) -> None:
    """torch.compile of the per-token cross-entropy (its fp32 upcast fused into the softmax),
    without tensor parallelism: the vocab-parallel loss has collectives. The FSDP2 peer of
    benchmarks/bench_gpt.py calls it too."""
    if module.tensor_parallel is None:
        module.cross_entropy = torch.compile(module.cross_entropy)


def bf16_all_reduce_hook(group: torch.distributed.ProcessGroup, bucket):
    """DDP comm hook: average each grad bucket across ranks in bf16 (torch's own
    bf16_compress_hook needs NCCL; this one also runs on gloo)."""
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(done.value()[0])
        return out

    return future.then(decompress)


def _build_ddp(
    config: TransformerConfig, *, setup: ModelSetupConfig, env: DistributedEnv, initial_params
):
    module = GPTModel(
        config,
        seed=setup.seed,
        expert_parallel_group=env.expert_groups.ep,
        tensor_parallel=env.tensor_parallel,
    ).to(env.device)
    if initial_params is not None:
        if env.tensor_parallel is not None:
            raise ValueError("initial_params (full tensors) with tensor parallelism is not built")
        module.load_state_dict(initial_params, strict=True)

    def shard(module: GPTModel) -> tuple[nn.Module, MegatronOptimizer]:
        return _wrap_ddp(module, setup=setup, env=env)

    return module, shard


def _wrap_ddp(module: GPTModel, *, setup: ModelSetupConfig, env: DistributedEnv):
    model: nn.Module = module
    expert_names = list(local_expert_rows(module)) if env.expert_groups.ep is not None else []
    if env.data_parallel_size > 1:
        # Routed experts differ across the EP ranks: DDP leaves them to expert_grad_sync.
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, expert_names
        )
        # torch 2.13 warns that broadcast_buffers is deprecated; its replacement,
        # forward_sync_buffers=False, still syncs buffers at init, and the warning itself says
        # to keep broadcast_buffers=False for rank-local buffers until init_sync_buffers
        # exists. The warning stays visible (the package silences no deprecation).
        model = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=env.dp_group,
            broadcast_buffers=False,
        )
        if setup.grad_reduce_in_bf16:
            # Megatron-LM's --grad-reduce-in-bf16 under DDP: the all-reduce runs in bf16.
            model.register_comm_hook(env.dp_group, bf16_all_reduce_hook)
    optimizer = MixedPrecisionOptimizer(
        module,
        config=setup.optimizer,
        expert_parallel_group=env.expert_groups.ep,
        expert_param_names=expert_names,
        **_tensor_parallel_norm(module, env),
    )
    return model, optimizer


def expert_grad_sync(module: GPTModel, env: DistributedEnv) -> Callable[[], None] | None:
    """The expert-grad reduction DDP leaves out with expert parallelism (None without it)."""
    if env.expert_groups.ep is None:
        return None
    params = dict(module.named_parameters())
    experts = [params[name] for name in local_expert_rows(module)]

    def sync() -> None:
        reduce_expert_grads(experts, env.expert_groups, dp_size=env.data_parallel_size)

    return sync


def _tensor_parallel_norm(module: GPTModel, env: DistributedEnv) -> dict:
    """Under tensor parallelism the grad norm sums each TP shard once and each replicated
    param once (on TP rank 0) over the TP group, as Megatron-LM's clip_grad_norm."""
    tensor_parallel = env.tensor_parallel
    if tensor_parallel is None:
        return {}
    names = set(TensorParallelGrads.of_model(module, tensor_parallel).counted_names)
    return {
        "grad_group": tensor_parallel.group,
        "norm_param_names": names,
        "tensor_parallel_placement": tensor_parallel_placement(module, tensor_parallel),
    }


def _build_megatron_fsdp(
    config: TransformerConfig, *, setup: ModelSetupConfig, env: DistributedEnv, initial_params
):
    fsdp_config = setup.fsdp
    ep_group = env.expert_groups.ep
    parallel = dict(expert_parallel_group=ep_group, tensor_parallel=env.tensor_parallel)
    if initial_params is not None and env.tensor_parallel is not None:
        raise ValueError("initial_params (full tensors) with tensor parallelism is not built")
    if fsdp_config.init_model_with_meta_device:
        with torch.device("meta"):
            module = GPTModel(config, seed=setup.seed, **parallel)
    else:
        module = GPTModel(config, seed=setup.seed, **parallel).to(env.device)
        if initial_params is not None:
            module.load_state_dict(initial_params, strict=True)
    expert_rows = local_expert_rows(module) if ep_group is not None else {}
    tp_owners = tensor_parallel_shards(module)

    def init_fn(name: str, tensor: torch.Tensor) -> None:
        rows = expert_rows.get(name)
        owner = tp_owners.get(name)
        if owner is not None:  # the full tensor drawn, this rank's TP shard kept
            leaf = name.rsplit(".", 1)[-1]
            full = tensor.new_empty(owner.full_shape(leaf))
            init_parameter_(full, name=name, config=config, seed=setup.seed)
            tensor.copy_(owner.shard_of_full(leaf, full))
        elif initial_params is not None:
            value = initial_params[name]
            tensor.copy_(value if rows is None or len(value) == len(tensor) else value[rows])
        elif rows is None:
            init_parameter_(tensor, name=name, config=config, seed=setup.seed)
        else:  # every expert drawn, this rank's kept: the same values at any EP size
            full = tensor.new_empty((config.num_moe_experts, *tensor.shape[1:]))
            init_parameter_(full, name=name, config=config, seed=setup.seed)
            tensor.copy_(full[rows])

    def shard(module: GPTModel) -> tuple[nn.Module, MegatronOptimizer]:
        model = FullyShardedDataParallel(
            module,
            fsdp_config=fsdp_config,
            # Inner (shard) and, with --num-distributed-optimizer-instances > 1, outer groups.
            device_mesh=env.dp_mesh,
            dp_shard_dim=DP_SHARD_DIM,
            dp_outer_dim=DP_OUTER_DIM,
            device=env.device,
            init_fn=init_fn,
            # With fp8_param_gather the engine keeps Fp8Linear weights only as FP8 bytes plus
            # fp32 main shards, seeded from the exact high-precision values.
            fp8_config=config.fp8,
            # Expert parallelism: the routed experts' own buffer groups over the EDP ranks of
            # this rank's replica (the whole EDP group without HSDP; expert_parallel.py).
            expert_data_parallel_group=env.expert_groups.expert_dp_shard if ep_group else None,
            expert_param_names=list(expert_rows),
            tensor_parallel=env.tensor_parallel,
            expert_parallel_group=ep_group,
        )
        return model, model.build_optimizer(setup.optimizer)

    return module, shard


def _build_torch_fsdp2(
    config: TransformerConfig, *, setup: ModelSetupConfig, env: DistributedEnv, initial_params
):
    """--use-torch-fsdp2 (Megatron-LM's flag): PyTorch's fully_shard on every transformer layer
    and on the model. Parameters are fp32 DTensor shards; forward and backward run in the
    --bf16 dtype through FSDP2's mixed-precision policy, grads are reduce-scattered in fp32.
    The optimizer steps the shards in place (their grads are shards too)."""
    import dataclasses

    if initial_params is not None:
        raise ValueError(
            "--use-torch-fsdp2 builds from its own init; imported weights go "
            "through DDP or Megatron-FSDP"
        )
    compute_dtype = config.params_dtype
    config = dataclasses.replace(config, params_dtype=torch.float32)
    with torch.device("meta"):
        module = GPTModel(config, seed=setup.seed)

    def shard(module: GPTModel) -> tuple[nn.Module, MegatronOptimizer]:
        _fully_shard(module, config, compute_dtype=compute_dtype, setup=setup, env=env)
        return module, MixedPrecisionOptimizer(
            module, config=setup.optimizer, grad_group=env.dp_group
        )

    return module, shard


def _fully_shard(
    module: GPTModel,
    config: TransformerConfig,
    *,
    compute_dtype: torch.dtype,
    setup: ModelSetupConfig,
    env: DistributedEnv,
) -> None:
    """fully_shard on every layer and the model, then the init values, sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.bfloat16 if setup.grad_reduce_in_bf16 else torch.float32,
    )
    for layer in module.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    module.to_empty(device=env.device)
    with torch.no_grad():  # the values DDP starts from, one full tensor at a time, then sharded
        for name, param in module.named_parameters():
            full = torch.empty(param.shape, dtype=param.dtype, device=env.device)
            init_parameter_(full, name=name, config=config, seed=setup.seed)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    module.init_buffers(env.device)


def setup_model_and_optimizer(
    setup: ModelSetupConfig,
    *,
    config: TransformerConfig,
    env: DistributedEnv,
    initial_params: dict[str, torch.Tensor] | None = None,
) -> ModelAndOptimizer:
    """`initial_params` (full tensors by parameter name) replace the init: the converter
    builds a run from imported weights this way and saves it with save_checkpoint."""
    build = _build_megatron_fsdp if setup.use_megatron_fsdp else _build_ddp
    if setup.use_torch_fsdp2:
        build = _build_torch_fsdp2
    module, shard = build(config, setup=setup, env=env, initial_params=initial_params)
    model, optimizer = apply_model_setup(module, config, setup=setup, env=env, shard=shard)
    optimizer.count_zeros_in_grad = setup.log_num_zeros_in_grad

    return ModelAndOptimizer(
        model=model,
        module=module,
        optimizer=optimizer,
        config=config,
        flops_per_iteration=num_floating_point_operations(
            config, batch_size=setup.global_batch_size, seq_length=setup.seq_length
        ),
        num_parameters=count_parameters(module),
        grad_scaler=build_grad_scaler(setup.loss_scale),
        expert_grad_sync=expert_grad_sync(module, env) if build is _build_ddp else None,
    )
