"""--use-checkpoint-args: the model flags and the vocabulary rows taken from the checkpoint
that --load names, at parse time (before validation), as Megatron-LM's
load_args_from_checkpoint does."""

from __future__ import annotations

import argparse

from megatron.core.checkpoint_files import CheckpointError
from megatron.training.checkpoint.layout import (
    TRACKER_FILENAME,
    read_metadata,
    read_tracker,
    resolve_iteration_dir,
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


def load_args_from_checkpoint(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: set the model flags and the vocabulary rows (padded_vocab_size)
    from the checkpoint --load names, before validation; returns one line per flag changed.
    CheckpointError names the file when there is no checkpoint to read them from."""
    if args.load is None:
        raise CheckpointError("--use-checkpoint-args reads the flags of --load DIR; pass --load.")
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    if iteration is None:
        raise CheckpointError(
            f"--use-checkpoint-args: --load {args.load} holds no {TRACKER_FILENAME}, so there "
            "are no saved flags to use; pass a --save directory (or drop the flag)."
        )
    metadata = read_metadata(resolve_iteration_dir(args.load, iteration))
    saved = metadata["args"]
    changed = []
    for name in CHECKPOINT_MODEL_ARGS:
        if name in saved and saved[name] != getattr(args, name):
            changed.append(
                f"--{name.replace('_', '-')} {saved[name]} (command line: {getattr(args, name)})"
            )
            setattr(args, name, saved[name])
    vocab_rows = metadata["model_config"].get("vocab_size")
    if isinstance(vocab_rows, int):
        args.padded_vocab_size = vocab_rows
    if args.ckpt_format is None:
        args.ckpt_format = metadata["ckpt_format"]
    return changed
