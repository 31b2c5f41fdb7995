"""Process-group setup from torchrun/Slurm environment variables, and seeding."""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron.core.distributed.data_parallel_mesh import (
    DP_OUTER_DIM,
    TP_DIM,
    DataParallelGroups,
    build_data_parallel_mesh,
)
from megatron.core.distributed.expert_parallel import (
    ExpertParallelGroups,
    build_expert_parallel_groups,
)
from megatron.core.environment import adopt_slurm_launch, env_int, get_env
from megatron.core.tensor_parallel import TensorParallel
from megatron.training.flags.run_config import DistributedConfig


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_group: dist.ProcessGroup | None
    """The data-parallel group (all ranks); None for a single process."""
    owns_process_group: bool = False
    """Whether initialize_distributed created the default group (and so must destroy it)."""
    dp_mesh: DeviceMesh | None = None
    """Megatron-FSDP: the (dp_outer, dp_shard) mesh, from --num-distributed-optimizer-instances,
    with an innermost tp dimension under tensor parallelism; the engine cuts its groups from
    it. None for torch DDP."""
    expert_groups: ExpertParallelGroups = ExpertParallelGroups(ep=None, expert_dp=None)
    """--expert-model-parallel-size: the expert-parallel and expert-data-parallel groups,
    built once here and passed to the MoE layers and the grad reduction."""

    tensor_parallel: TensorParallel | None = None
    """--tensor-model-parallel-size > 1: this rank's tensor-parallel group (then `dp_group` is
    the data-parallel group of the ranks holding the same shards); None without TP."""

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.size

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: the world size over the tensor-parallel size."""
        if self.tensor_parallel is None:
            return self.world_size
        return dist.get_world_size(self.dp_group)

    @property
    def data_parallel_rank(self) -> int:
        """Which replica this rank is (the slice of each global batch it reads)."""
        if self.tensor_parallel is None:
            return self.rank
        return dist.get_rank(self.dp_group)

    @property
    def all_ranks_group(self) -> dist.ProcessGroup | None:
        """Every rank (for agreements such as when to stop); None for a single process."""
        return self.dp_group if self.tensor_parallel is None else dist.group.WORLD


def initialize_distributed(config: DistributedConfig) -> DistributedEnv:
    """Init the default process group when launched with several ranks; pick the device."""
    adopt_slurm_launch()
    world_size = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU.")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dp_group = None
    owns_process_group = False
    # A single process that needs a process group (config.always_use_process_group) gets a
    # one-rank group from an in-memory store.
    if world_size > 1 or config.always_use_process_group:
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=config.timeout_minutes),
                device_id=device if backend == "nccl" else None,
                store=dist.HashStore() if world_size == 1 else _attempt_store(rank, world_size),
            )
            owns_process_group = True
        dp_group = dist.group.WORLD
    tensor_parallel = None
    dp_mesh = None
    if config.use_megatron_fsdp:
        dp_mesh, tensor_parallel = _megatron_fsdp_mesh(config, world_size, device)
        if tensor_parallel is not None:  # the ranks of equal TP rank
            dp_group = DataParallelGroups.from_mesh(dp_mesh, outer_dim=DP_OUTER_DIM).full
    elif config.tensor_model_parallel_size > 1:
        dp_group, tensor_parallel = _tensor_and_data_parallel_groups(config, world_size, device)
    expert_groups = build_expert_parallel_groups(
        ep_size=config.expert_model_parallel_size,
        dp_group=dp_group,
        instances=config.num_distributed_optimizer_instances if config.use_megatron_fsdp else 1,
    )
    return DistributedEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        dp_group=dp_group,
        owns_process_group=owns_process_group,
        dp_mesh=dp_mesh,
        expert_groups=expert_groups,
        tensor_parallel=tensor_parallel,
    )


def _megatron_fsdp_mesh(
    config: DistributedConfig, world_size: int, device: torch.device
) -> tuple[DeviceMesh, TensorParallel | None]:
    """The one (dp_outer, dp_shard[, tp]) mesh of Megatron-FSDP, and its TP group: the engine
    cuts its DP groups from the same mesh."""
    mesh = build_data_parallel_mesh(
        world_size=world_size,
        num_distributed_optimizer_instances=config.num_distributed_optimizer_instances,
        device_type=device.type,
        tensor_parallel_size=config.tensor_model_parallel_size,
    )
    if config.tensor_model_parallel_size == 1:
        return mesh, None
    return mesh, TensorParallel(mesh.get_group(TP_DIM), sequence_parallel=config.sequence_parallel)


TENSOR_PARALLEL_DIM = "tp"
DATA_PARALLEL_DIM = "dp"


def _tensor_and_data_parallel_groups(
    config: DistributedConfig, world_size: int, device: torch.device
) -> tuple[dist.ProcessGroup, TensorParallel]:
    """The (dp, tp) mesh of all ranks in Megatron-LM's order, built once: rank = dp * tp_size +
    tp_rank, so a tensor-parallel group is tp_size consecutive ranks (one node's fast links)
    and a data-parallel group is the ranks of equal tp_rank."""
    tp_size = config.tensor_model_parallel_size
    if world_size % tp_size:
        raise SystemExit(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{tp_size}; launch a multiple of {tp_size} ranks"
        )
    mesh = init_device_mesh(
        device.type,
        (world_size // tp_size, tp_size),
        mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM),
    )
    tensor_parallel = TensorParallel(
        mesh.get_group(TENSOR_PARALLEL_DIM), sequence_parallel=config.sequence_parallel
    )
    return mesh.get_group(DATA_PARALLEL_DIM), tensor_parallel


ATTEMPT_HANDSHAKE_POLL_S = 0.01
"""Rank 0's pause between looks for the other ranks' tokens: short next to a process start."""


def _attempt_store(rank: int, world_size: int) -> dist.Store | None:
    """A store namespace of this worker group's own, under torchrun's shared store; else None
    (init_process_group then builds its store from MASTER_ADDR/MASTER_PORT as usual).

    torchrun (c10d or static rendezvous) keeps one TCPStore for the whole job and hands every
    restarted worker group the same one, so keys from a killed group (gloo's peer addresses, the
    init barrier's counters) are still there: after `--max-restarts` restarted the group, a rank
    read the dead rank 0's address (gloo: "connectFullMesh failed ... Connection refused") or
    waited on a stale counter until the 30-minute timeout (torch 2.13; pytorch issues 135712,
    167288). TORCHELASTIC_RESTART_COUNT cannot name the group: each node's agent counts its own
    restarts, and a node restarted for a membership change does not count one.

    So the group agrees on a fresh random name: every other rank queues a fresh token, rank 0
    answers each token it finds with its own fresh nonce, and waits until all have answered
    under that nonce. A stale answer cannot match a fresh token, so every rank ends up with the
    nonce of this group's rank 0."""
    if get_env("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(
        get_env("MASTER_ADDR"),
        int(get_env("MASTER_PORT")),
        world_size,
        is_master=False,
        timeout=timedelta(minutes=30),
    )
    handshake = dist.PrefixStore("megatron-fp8/handshake", shared)
    if rank == 0:
        nonce = secrets.token_hex(16)
        answered, queued = set(), 0
        while int(handshake.add(f"joined/{nonce}", 0)) < world_size - 1:
            queued = int(handshake.add("queue", 0))
            # Entries of killed groups stay queued (some never got their token written, so
            # `check` first: `get` would wait for them); answering them again is harmless.
            for index in range(1, queued + 1):
                key = f"queue/{index}"
                if index not in answered and handshake.check([key]):
                    handshake.set(f"answer/{handshake.get(key).decode()}", nonce)
                    answered.add(index)
            time.sleep(ATTEMPT_HANDSHAKE_POLL_S)
    else:
        token = secrets.token_hex(16)
        handshake.set(f"queue/{handshake.add('queue', 1)}", token)
        nonce = handshake.get(f"answer/{token}").decode()  # waits for this group's rank 0
        handshake.add(f"joined/{nonce}", 1)
    return dist.PrefixStore(f"megatron-fp8/group/{nonce}", shared)


def shutdown_distributed(env: DistributedEnv, *, destroy: bool = True) -> None:
    """End the run's collectives: a barrier (no rank leaves while another still talks), then,
    with `destroy`, tear the default group down. A library caller that keeps its interpreter
    needs the destroy: a gloo group left to interpreter teardown can abort ("terminate called
    without an active exception") while its threads still run. pretrain_gpt.py passes
    destroy=False and leaves with os._exit, which runs no teardown: with the destroy, 2-rank
    CPU torchrun runs hung after their last iteration (9 of 240 under load, and once in CI),
    one rank's main thread stuck returning from pretrain(), i.e. in the destructors of the
    destroyed group's objects; without it, 0 of 240."""
    if env.owns_process_group and dist.is_initialized():
        dist.barrier(group=env.dp_group)
        if destroy:
            dist.destroy_process_group()


def set_random_seeds(seed: int) -> None:
    """Same seed on every rank, so the init does not depend on the data-parallel size. Dropout
    masks are reseeded per micro-batch from its first global sample (training.seed_dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_rng_state() -> dict:
    """Every RNG the training step draws from, as plain tensors/values (checkpointable)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
