"""Process-group setup from torchrun/Slurm environment variables, and seeding."""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.distributed.data_parallel_mesh import build_data_parallel_mesh


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
    """Megatron-FSDP: the (dp_outer, dp_shard) mesh, from --num-distributed-optimizer-instances;
    the engine cuts its groups from it. None for torch DDP."""


def _slurm_to_torchrun_env() -> None:
    """Under `srun` without torchrun, map Slurm's task variables onto torchrun's names."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def initialize_distributed(args: argparse.Namespace) -> DistributedEnv:
    """Init the default process group when launched with several ranks; pick the device."""
    _slurm_to_torchrun_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU.")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dp_group = None
    owns_process_group = False
    # Megatron-FSDP always runs on a process group (its collectives and sharded checkpoints
    # need one), so a single process gets a one-rank group from an in-memory store.
    if world_size > 1 or args.use_megatron_fsdp:
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=30),
                device_id=device if backend == "nccl" else None,
                store=dist.HashStore() if world_size == 1 else None,
            )
            owns_process_group = True
        dp_group = dist.group.WORLD
    dp_mesh = None
    if args.use_megatron_fsdp:
        dp_mesh = build_data_parallel_mesh(
            world_size=world_size,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
            device_type=device.type,
        )
    return DistributedEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        dp_group=dp_group,
        owns_process_group=owns_process_group,
        dp_mesh=dp_mesh,
    )


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
