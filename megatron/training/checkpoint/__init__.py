"""Checkpoints: `latest_checkpointed_iteration.txt` plus `iter_0000100/`, written atomically.

Layout of one `iter_XXXXXXX/` directory (`--ckpt-format torch`):
  metadata.json       format tag, iteration, consumed samples, counters, scheduler state, the
                      model config and the flags (plain JSON)
  model.pt            {param name: fp32 tensor}, the main (fp32) values of every parameter
  optimizer.pt        the optimizer state (tensors and numbers only; not with --no-save-optim)
  rng/rank_00000.pt   each rank's RNG states (tensors and numbers only; not with --no-save-rng)
  fp8_delayed_scaling.pt  with --fp8-recipe delayed: every FP8 tensor's scale and amax history
`--ckpt-format torch_dist` (DDP, Megatron-FSDP or FSDP2; `fsdp_dtensor` is Megatron-FSDP's name for
the same layout) keeps metadata.json and stores model and optimizer under `sharded/` through
megatron.core.dist_checkpointing (sharded.py says which state; routed experts of an
expert-parallel run as the full [num_experts, ...] tensors, so any EP size loads them);
with --async-save those files are written by a background thread (async_save.py) and
published, tracker last, once every rank's write completed.

Everything is written under `<dir>.tmp`, fsynced, and published when complete: a previous
`<dir>` (a re-save of the same iteration) is renamed to `<dir>.old` first and deleted only once
the new one is in place (megatron/core/checkpoint_files.py); then the tracker file is replaced
atomically. A kill between those renames leaves `<dir>.old` and no `<dir>`: that copy is complete,
and loading uses it. Loading a `torch` checkpoint uses `torch.load(weights_only=True)` and JSON
only, so one from an untrusted source cannot run code (torch_dist's `.metadata`, read by
torch.distributed.checkpoint, is read through a restricted unpickler); a missing, truncated or
malformed file, or one that does not fit this run's flags, raises CheckpointError naming the
file and the fix before training.

The code is split by responsibility: layout.py (names, tracker, metadata.json and
file reading, export), save.py, load.py, and checks.py (does a
checkpoint fit this run). This module gathers their public names.
"""

from __future__ import annotations

from megatron.core.checkpoint_files import CheckpointError
from megatron.training.checkpoint.checks import check_saved_flags, check_saved_param_shapes
from megatron.training.checkpoint.layout import (
    FORMAT_TAG,
    FORMAT_VERSION,
    REQUIRED_METADATA,
    TRACKER_FILENAME,
    check_load_path,
    complete_iteration_dirs,
    config_from_json,
    config_to_json,
    iteration_dir,
    load_state_for_export,
    load_tensor_file,
    model_buffers,
    read_metadata,
    read_tracker,
    resolve_iteration_dir,
)
from megatron.training.checkpoint.load import load_checkpoint
from megatron.training.checkpoint.save import CheckpointSaveError, finish_save, save_checkpoint
from megatron.training.flags.run_config import ARCHITECTURE_FLAGS

__all__ = [
    "ARCHITECTURE_FLAGS",
    "FORMAT_TAG",
    "FORMAT_VERSION",
    "REQUIRED_METADATA",
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointSaveError",
    "check_load_path",
    "check_saved_flags",
    "check_saved_param_shapes",
    "complete_iteration_dirs",
    "config_from_json",
    "config_to_json",
    "finish_save",
    "iteration_dir",
    "load_checkpoint",
    "load_state_for_export",
    "load_tensor_file",
    "model_buffers",
    "read_metadata",
    "read_tracker",
    "resolve_iteration_dir",
    "save_checkpoint",
]
