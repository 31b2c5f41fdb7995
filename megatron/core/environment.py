"""Every environment variable that megatron/ (and pretrain_gpt.py) reads, and the one place
that reads them: VARIABLES names each with who sets it and why the run reads it. A name
not in the table is refused, so that a new one is added here with its reason."""

from __future__ import annotations

import os

VARIABLES: dict[str, str] = {
    "RANK": "torchrun (or SLURM_PROCID, see adopt_slurm_launch): this process's rank",
    "WORLD_SIZE": "torchrun (or SLURM_NTASKS): the number of ranks, the data-parallel size",
    "LOCAL_RANK": "torchrun (or SLURM_LOCALID): the GPU this process drives",
    "SLURM_PROCID": "srun without torchrun: this task's rank, mapped onto RANK",
    "SLURM_NTASKS": "srun without torchrun: the number of tasks, mapped onto WORLD_SIZE",
    "SLURM_LOCALID": "srun without torchrun: the task's index on its node, onto LOCAL_RANK",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun: 'True' when the ranks share the agent's "
    "TCPStore, which the restart handshake of initialize.py uses",
    "MASTER_ADDR": "torchrun: the host of the agent's TCPStore",
    "MASTER_PORT": "torchrun: the port of the agent's TCPStore",
    "WANDB_API_KEY": "the user: with it W&B logs online, without it offline",
    "MEGATRON_GPT2_BPE_CACHE": "the user: where GPT2BPETokenizer caches its checked vocabulary "
    "tables (off, 0 or empty: no cache)",
    "XDG_CACHE_HOME": "the desktop convention: the cache root when MEGATRON_GPT2_BPE_CACHE is "
    "unset (else ~/.cache)",
    "MEGATRON_TRACEBACK": "the user: '1' makes pretrain_gpt.py raise a user error with its "
    "traceback instead of one `error:` line",
}


def get_env(name: str, default: str | None = None) -> str | None:
    """The variable's value, or `default` when it is unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in megatron.core.environment.VARIABLES; add it there")
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    """An integer variable (a rank or a size), `default` when it is unset."""
    return int(get_env(name, str(default)))


def adopt_slurm_launch() -> None:
    """Under `srun` without torchrun, map Slurm's task variables onto torchrun's names."""
    if get_env("RANK") is not None or get_env("SLURM_PROCID") is None:
        return
    os.environ["RANK"] = get_env("SLURM_PROCID")
    os.environ["WORLD_SIZE"] = get_env("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = get_env("SLURM_LOCALID", "0")
