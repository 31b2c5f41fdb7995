"""Our own checkpoints, read and written by megatron/training/checkpoint.py itself.

Loading goes through `load_state_for_export` (any --ckpt-format, any data-parallel size; FP8
runs give their fp32 main weights). Saving builds the run pretrain_gpt.py would build for the
model's flags (config_to_argv) with the imported weights in place of the init, and calls
`save_checkpoint`: the result is an ordinary --save directory (iteration 0 for an import) with
no optimizer or RNG state, which `pretrain_gpt.py --load DIR --finetune` (or
`--no-load-optim --no-load-rng`) continues from, and whose recorded flags
`--use-checkpoint-args` reads.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.optimizer import OptimizerParamScheduler
from megatron.training import checkpoint as checkpointing
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_run_config, build_transformer_config
from megatron.training.initialize import initialize_distributed, shutdown_distributed
from megatron.training.model_setup import setup_model_and_optimizer
from megatron.training.train_state import TrainState
from tools.checkpoint.model_flags import config_to_argv
from tools.checkpoint.model_state import (
    ConversionError,
    ModelState,
    check_model_state,
    model_config,
    write_dir_atomically,
)

# Sharded formats are written by Megatron-FSDP, which every sharded format supports.
SHARDED_FORMATS_ENGINE = ["--use-megatron-fsdp"]


def load_megatron_fp8(load_dir: str, iteration: int | None = None) -> ModelState:
    try:
        state_dict, config = checkpointing.load_state_for_export(load_dir, iteration)
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    if iteration is None:
        directory = load_dir
        if not os.path.isfile(os.path.join(load_dir, "metadata.json")):
            directory = checkpointing.resolve_iteration_dir(
                load_dir, checkpointing.read_tracker(load_dir)
            )
        iteration = checkpointing.read_metadata(directory)["iteration"]
    state = ModelState(state_dict=state_dict, config=model_config(config), iteration=iteration)
    check_model_state(state, source=load_dir)
    return state


def _saver_args(state: ModelState, *, save: str, ckpt_format: str):
    config = state.config
    argv = config_to_argv(config) + [
        # The tokenizer is the user's choice at training time; the vocabulary rows are the
        # model's, so they are recorded unpadded-as-is (divisible by 1).
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(config.vocab_size),
        "--make-vocab-size-divisible-by",
        "1",
        "--mock-data",
        "--seq-length",
        str(min(config.max_sequence_length, 4096)),
        "--micro-batch-size",
        "1",
        "--train-iters",
        "1",
        "--eval-iters",
        "0",
        "--save",
        save,
        "--ckpt-format",
        ckpt_format,
        "--no-save-optim",
        "--no-save-rng",
    ]
    if ckpt_format != "torch":
        argv += SHARDED_FORMATS_ENGINE
    if config.params_dtype == torch.bfloat16:
        argv.append("--bf16")
    try:
        return parse_args(argv, world_size=1)
    except SystemExit:
        raise ConversionError(
            f"the model's flags ({' '.join(config_to_argv(config))}) are not valid "
            "pretrain_gpt.py flags (see the error line above)"
        ) from None


def _copy_buffers(state: ModelState, run) -> None:
    """The model state beside the parameters (routers' expert biases) into the run, which
    the checkpoint writes (model_buffers.pt); a buffer the source lacks keeps its init."""
    with torch.no_grad():
        for name, buf in checkpointing.model_buffers(run).items():
            if name in state.state_dict:
                buf.copy_(state.state_dict[name])


def save_megatron_fp8(state: ModelState, save_dir: str, *, ckpt_format: str = "torch") -> None:
    check_model_state(state, source="the converted model")
    # Everything that can refuse the model runs before the first byte is written.
    probe = _saver_args(state, save=save_dir, ckpt_format=ckpt_format)
    config = build_transformer_config(probe, vocab_size=state.config.vocab_size)
    # The dtype may differ (an fp16 source trains in fp32): the checkpoint holds fp32 main
    # weights either way, which fp16 and bf16 values convert to exactly.
    wanted = dataclasses.replace(state.config, params_dtype=config.params_dtype)
    if dataclasses.asdict(config) != dataclasses.asdict(wanted):
        raise ConversionError(
            f"pretrain_gpt.py's flags cannot express this model: the flags build {config}, "
            f"the source is {state.config}"
        )

    def write(tmp: str) -> None:
        run_config = build_run_config(
            _saver_args(state, save=tmp, ckpt_format=ckpt_format), world_size=1
        )
        env = initialize_distributed(run_config.distributed)
        try:
            run = setup_model_and_optimizer(
                run_config.model_setup, config=config, env=env, initial_params=state.state_dict
            )
            _copy_buffers(state, run)
            scheduler = OptimizerParamScheduler(run.optimizer, config=run_config.lr_schedule)
            train_state = TrainState(iteration=state.iteration)
            # The tokenizer is the user's choice when training from it: none is recorded, so a
            # resume does not compare the probe's NullTokenizer and rows with the user's.
            unrecorded = dict(tokenizer_type=None, vocab_size=None)
            checkpoint = dataclasses.replace(
                run_config.checkpoint,
                saved_args={**run_config.checkpoint.saved_args, **unrecorded},
                resolved_args={**run_config.checkpoint.resolved_args, **unrecorded},
            )
            # Through the module, so a test can stand in for the save.
            checkpointing.save_checkpoint(
                checkpoint, run=run, scheduler=scheduler, state=train_state, env=env
            )
        finally:
            shutdown_distributed(env)

    write_dir_atomically(save_dir, write)
