"""--use-checkpoint-args: the model flags taken from the checkpoint that --load names, at parse
time (before validation), as Megatron-LM's load_args_from_checkpoint does; its vocabulary rows
and format are read for configs.resolved_flags."""

from __future__ import annotations

import argparse

from megatron.core.checkpoint_files import CheckpointError
from megatron.training.checkpoint.layout import (
    TRACKER_FILENAME,
    read_metadata,
    read_tracker,
    resolve_iteration_dir,
    saved_run_flags,
)
from megatron.training.flags.run_config import ARCHITECTURE_FLAGS

# What --use-checkpoint-args takes from the checkpoint (Megatron-LM's load_args_from_checkpoint
# takes the same model flags), besides the vocabulary rows.
CHECKPOINT_MODEL_ARGS = ARCHITECTURE_FLAGS + (
    "group_query_attention",
    "max_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "norm_epsilon",
    "make_vocab_size_divisible_by",
)


def _checkpoint_metadata(args: argparse.Namespace) -> dict:
    """metadata.json of the checkpoint --load (--ckpt-step) names, or CheckpointError."""
    if args.load is None:
        raise CheckpointError("--use-checkpoint-args reads the flags of --load DIR; pass --load.")
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    if iteration is None:
        raise CheckpointError(
            f"--use-checkpoint-args: --load {args.load} holds no {TRACKER_FILENAME}, so there "
            "are no saved flags to use; pass a --save directory (or drop the flag)."
        )
    return read_metadata(resolve_iteration_dir(args.load, iteration))


def load_args_from_checkpoint(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: set the model flags from the checkpoint --load names, before
    validation; returns one line per flag changed."""
    saved = saved_run_flags(_checkpoint_metadata(args))
    changed = []
    for name in CHECKPOINT_MODEL_ARGS:
        if name in saved and saved[name] != getattr(args, name):
            changed.append(
                f"--{name.replace('_', '-')} {saved[name]} (command line: {getattr(args, name)})"
            )
            setattr(args, name, saved[name])
    return changed


def checkpoint_run_values(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """(vocabulary rows, --ckpt-format) of the checkpoint that --use-checkpoint-args reads, which
    configs.resolved_flags takes; (None, None) without the flag."""
    if not args.use_checkpoint_args:
        return None, None
    metadata = _checkpoint_metadata(args)
    rows = metadata["model_config"].get("vocab_size")
    return (rows if isinstance(rows, int) else None), metadata["ckpt_format"]
