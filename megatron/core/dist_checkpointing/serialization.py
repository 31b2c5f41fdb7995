"""Sharded save/load (`--ckpt-format torch_dist`) on torch.distributed.checkpoint.

`state` is a nested dict: Megatron-FSDP's model and optimizer sharded state dicts (flat
ShardedTensors, resharded by DCP to whatever DP size loads them), plus small replicated values
(iteration, scheduler state, ...), which every rank passes identically.

Atomic: everything is written to `<dir>.tmp` and rank 0 renames it to `<dir>` only after every
rank has finished, so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def save(
    state: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Write `state` to `checkpoint_dir` (collective over `process_group`)."""
    final = Path(checkpoint_dir)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank(process_group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=process_group)
    with warnings.catch_warnings():
        # DCP warns on every ShardedTensor (deprecated for DTensor, which cannot express the
        # uneven per-rank pieces FSDP shards are); nothing in it is actionable for a user.
        warnings.simplefilter("ignore", FutureWarning)
        dcp.save(state, checkpoint_id=str(tmp), process_group=process_group)
    dist.barrier(group=process_group)
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier(group=process_group)


def load(
    state: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Fill the template `state` in place from `checkpoint_dir` (collective).

    The template's sharded tensors describe this run's layout; DCP reads the matching ranges
    whatever DP size wrote them.
    """
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"dist_checkpointing.load: {path} is not a torch_dist checkpoint (no .metadata); "
            "check --load, or a '.tmp' sibling means the save did not finish"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor deprecation, as in save
        dcp.load(state, checkpoint_id=str(path), process_group=process_group)
