"""Sharded save/load (`--ckpt-format torch_dist`) on torch.distributed.checkpoint.

`state` is a nested dict: the model and optimizer state dicts (Megatron-FSDP's flat DTensor
pieces, resharded by DCP to whatever DP size loads them, or replicated tensors), plus small
replicated values (iteration, ...), which every rank passes identically.

Atomic: everything is written to `<dir>.tmp` (DCP fsyncs each file) and rank 0 publishes it as
`<dir>` only after every rank has finished, keeping the previous `<dir>` until the new one is in
place (megatron/core/checkpoint_files.py), so a crash never leaves a half-written checkpoint
under the final name. A checkpoint that cannot be read raises CheckpointError naming the path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.checkpoint_files import (
    CheckpointError,
    fsync_path,
    publish_dir,
    resolve_published_dir,
)
from megatron.core.dist_checkpointing.safe_reader import (
    SafeFileSystemReader,
    ShardReadError,
    UnsafeCheckpointError,
)


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
    dcp.save(state, checkpoint_id=str(tmp), process_group=process_group)
    dist.barrier(group=process_group)
    if rank == 0:
        fsync_path(tmp)
        publish_dir(tmp, final)
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
    path = checkpoint_path(checkpoint_dir)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), process_group=process_group)
    except (Exception, CheckpointException) as error:  # CheckpointException: BaseException
        raise load_error(path, error) from None


def load_error(path: Path, error: BaseException) -> CheckpointError:
    """The CheckpointError for a failed DCP load of `path`: a shard that cannot be read is named
    (from any rank), anything else (a size mismatch, a missing key) names the directory."""
    rank, cause = root_failure(error)
    if isinstance(cause, ShardReadError):
        where = "" if rank is None else f" (rank {rank} read it)"
        return CheckpointError(
            f"{cause.path}: cannot be read ({cause.cause}); the shard is truncated, corrupt or "
            f"missing, so {path} cannot be loaded{where}. Load another iteration."
        )
    return CheckpointError(
        f"{path}: cannot be loaded ({describe_failure(error)}); a shard (.distcp) or "
        ".metadata is truncated, corrupt or missing, or the checkpoint does not match "
        "this model. Load another iteration."
    )


def checkpoint_path(checkpoint_dir: str | os.PathLike) -> Path:
    """The complete checkpoint at checkpoint_dir (or its .old copy), with a readable .metadata.

    Every rank reads the same .metadata, so all fail alike, before any collective.
    """
    resolved = resolve_published_dir(checkpoint_dir)
    if resolved is None or not (Path(resolved) / ".metadata").is_file():
        raise CheckpointError(
            f"{checkpoint_dir}: not a torch_dist checkpoint (no .metadata); check --load, or a "
            "'.tmp' sibling means the save did not finish: load another iteration."
        )
    path = Path(resolved)
    try:
        SafeFileSystemReader(str(path)).read_metadata()
    except UnsafeCheckpointError as error:
        raise CheckpointError(
            f"{path / '.metadata'}: refused: it {error}. Load only checkpoints written by "
            "megatron-fp8 (or torch.distributed.checkpoint) from sources you trust."
        ) from None
    except Exception as error:  # a truncated pickle raises one of several types
        raise CheckpointError(
            f"{path / '.metadata'}: cannot be read ({describe_failure(error)}); the file is "
            "truncated or corrupt. Load another iteration."
        ) from None
    return path


def root_failure(error: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) behind DCP's collective CheckpointException, which wraps each failing
    rank's exception with its stack summary; the rank with an OSError (a full disk, say) is
    preferred, as its message says the most. Any other error: (None, error)."""
    if not (isinstance(error, CheckpointException) and error.failures):
        return None, error
    by_rank = [
        (rank, value[0] if isinstance(value, tuple) else value)
        for rank, value in sorted(error.failures.items())
    ]
    preferred = (ShardReadError, OSError)  # what names a file says the most
    return next(((r, e) for r, e in by_rank if isinstance(e, preferred)), by_rank[0])


def describe_failure(error: BaseException) -> str:
    """The root cause in one line: DCP wraps each rank's exception with its whole traceback."""
    _, error = root_failure(error)
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__
