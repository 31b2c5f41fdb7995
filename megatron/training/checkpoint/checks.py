"""Whether a checkpoint fits this run, checked before any tensor is read into the model: the
flags both must share (shapes, format, engine, FP8 history length, optimizer, batch size of a
--train-samples run), the parameter shapes recorded in metadata.json, and the learning-rate
schedule. Each mismatch raises CheckpointError naming the flag and the fix.
"""

from __future__ import annotations

import os

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.fp8.recipe import names_delayed_scaling
from megatron.core.transformer.transformer_config import resolved_shape
from megatron.training.checkpoint.layout import checkpoint_param_shapes, saved_run_flags
from megatron.training.checkpoint.sharded import SHARDED_FORMATS
from megatron.training.flags.run_config import ARCHITECTURE_FLAGS, CheckpointConfig
from megatron.training.model_setup import ModelAndOptimizer


def check_saved_flags(metadata: dict, config: CheckpointConfig, *, directory: str) -> None:
    """Flags whose saved value this run must share: shapes, the format, and (when the
    optimizer state is loaded) the optimizer, whose state keys differ (Adam moments vs SGD
    momentum). --no-load-optim and --finetune start a fresh optimizer, so any one is fine."""
    saved = saved_run_flags(metadata)
    check_architecture(saved, config.architecture, directory=directory)
    same_layout = {metadata["ckpt_format"], config.ckpt_format} <= set(SHARDED_FORMATS)
    if metadata["ckpt_format"] != config.ckpt_format and not same_layout:
        raise CheckpointError(
            f"{directory}: saved with --ckpt-format {metadata['ckpt_format']}, this run uses "
            f"{config.ckpt_format}; pass --ckpt-format {metadata['ckpt_format']}."
        )
    engine_changed = bool(saved.get("use_megatron_fsdp")) != bool(config.use_megatron_fsdp)
    if engine_changed and names_delayed_scaling(saved.get("fp8_recipe")) and not config.finetune:
        # DDP keeps the delayed-scaling state in fp8_delayed_scaling.pt, Megatron-FSDP in its
        # sharded state: neither engine finds the other's.
        raise CheckpointError(
            f"{directory}: a --fp8-recipe delayed checkpoint saved "
            f"{'with' if saved.get('use_megatron_fsdp') else 'without'} --use-megatron-fsdp; "
            "resume it under the same engine, or pass --finetune to load only the weights."
        )
    if not config.finetune:
        # This run's flags as its checkpoint would record them (resolved over as given).
        this_run = saved_run_flags(
            {"args": config.saved_args, "resolved_args": config.resolved_args}
        )
        _check_delayed_state(saved, this_run, config, directory=directory)
        _check_tokens(saved, this_run, directory=directory)
    if (
        not config.finetune
        and (config.train_samples is not None or saved.get("train_samples") is not None)
        and saved.get("global_batch_size", config.global_batch_size) != config.global_batch_size
    ):
        raise CheckpointError(
            f"{directory}: a --train-samples run saved with --global-batch-size "
            f"{saved['global_batch_size']}, but this run has {config.global_batch_size} (given, or "
            "micro-batch x data-parallel size); its iteration count and schedule are counted in "
            f"batches of {saved['global_batch_size']}. Pass --global-batch-size "
            f"{saved['global_batch_size']}."
        )
    load_optim = not (config.no_load_optim or config.finetune)
    # Megatron-LM's rule: a checkpoint without a state needs the flag that skips loading it.
    if load_optim and saved.get("no_save_optim", False):
        raise CheckpointError(
            f"{directory}: saved with --no-save-optim, so it holds no optimizer state; pass "
            "--no-load-optim (weights and iteration restored; optimizer and learning-rate "
            "schedule start fresh, as in Megatron-LM) or --finetune."
        )
    if not (config.no_load_rng or config.finetune) and saved.get("no_save_rng", False):
        raise CheckpointError(
            f"{directory}: saved with --no-save-rng, so it holds no RNG states; pass "
            "--no-load-rng (this run's --seed seeds the RNGs) or --finetune."
        )
    if load_optim and saved.get("optimizer", config.optimizer) != config.optimizer:
        raise CheckpointError(
            f"{directory}: saved with --optimizer {saved['optimizer']}, but this run has "
            f"--optimizer {config.optimizer}, which cannot use its state; pass --optimizer "
            f"{saved['optimizer']}, or --no-load-optim (or --finetune) to start "
            f"{config.optimizer} from fresh state."
        )


def _check_delayed_state(
    saved: dict, this_run: dict, config: CheckpointConfig, *, directory: str
) -> None:
    """Delayed-scaling state loads only into histories of its length, and its scales only
    into the FP8 dtypes they were computed for (--fp8-format)."""
    if not (
        names_delayed_scaling(saved.get("fp8_recipe")) and names_delayed_scaling(config.fp8_recipe)
    ):
        return
    saved_len = saved.get("fp8_amax_history_len")
    if saved_len != config.fp8_amax_history_len:
        raise CheckpointError(
            f"{directory}: saved with --fp8-amax-history-len {saved_len}, but this run has "
            f"{config.fp8_amax_history_len}; the saved amax histories ({saved_len} slots per FP8 "
            f"tensor) cannot be loaded into {config.fp8_amax_history_len}. Pass "
            f"--fp8-amax-history-len {saved_len}, or --finetune to load only the weights and "
            "start the delayed-scaling state fresh."
        )
    saved_format, this_format = saved.get("fp8_format"), this_run.get("fp8_format")
    if saved_format != this_format:
        raise CheckpointError(
            f"{directory}: a --fp8-recipe delayed checkpoint saved with --fp8-format "
            f"{saved_format}, but this run has {this_format}; its saved scales are for "
            f"{saved_format}'s FP8 dtypes (an E5M2 gradient scale saturates E4M3). Pass "
            f"--fp8-format {saved_format}, or --finetune to start the delayed-scaling state fresh."
        )


def _check_tokens(saved: dict, this_run: dict, *, directory: str) -> None:
    """The tokenizer and vocabulary size a run trains with are its checkpoint's (Megatron-LM
    compares the tokenizer type): padded rows can match while the ids mean other tokens."""
    for flag in ("tokenizer_type", "vocab_size"):
        before, now = saved.get(flag), this_run.get(flag)
        if before is not None and now is not None and before != now:
            name = "--" + flag.replace("_", "-")
            raise CheckpointError(
                f"{directory}: saved with {name} {before}, but this run has {now}: the token "
                f"ids would mean other tokens. Pass {name} {before}, or --finetune to load "
                "only the weights."
            )


def _resolved(flags: dict) -> dict:
    """The architecture flags with an omitted size replaced by the size it stands for."""
    values = {flag: flags.get(flag) for flag in ARCHITECTURE_FLAGS}
    if isinstance(values["hidden_size"], int) and isinstance(values["num_attention_heads"], int):
        values.update(resolved_shape(**{flag: values[flag] for flag in _SHAPE_FLAGS}))
    return values


_SHAPE_FLAGS = (
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "num_query_groups",
    "kv_channels",
)


def check_architecture(saved: dict, architecture: dict, *, directory: str) -> None:
    """The shape flags, compared by the values they resolve to (--kv-channels 16 is the
    omitted --kv-channels of a hidden 64, 4-head checkpoint); every mismatch in one message,
    as --use-checkpoint-args would list them."""
    saved_values, run_values = _resolved(saved), _resolved(architecture)
    differ = [
        f"--{flag.replace('_', '-')} {saved_values[flag]}, but this run has {run_values[flag]}"
        for flag in ARCHITECTURE_FLAGS
        if flag in saved and saved_values[flag] != run_values[flag]
    ]
    if differ:
        raise CheckpointError(
            f"{directory}: saved with {'; '.join(differ)}; use the checkpoint's values "
            "(or --use-checkpoint-args to take them all)."
        )


def _shape_fix(name: str, saved: tuple, expected: tuple, saved_flags: dict) -> str:
    """The flag behind a parameter's shape (what a user changed), named for the message."""
    if name.endswith("word_embeddings.weight") or name.startswith("output_layer."):
        vocab = saved_flags.get("vocab_size")
        return (
            f"the padded vocabulary differs (checkpoint {saved[0]}, this run {expected[0]}): "
            f"pass {f'--vocab-size {vocab}' if vocab else 'the checkpoint tokenizer'} and "
            f"--make-vocab-size-divisible-by {saved_flags.get('make_vocab_size_divisible_by')}, "
            "as saved"
        )
    if name.endswith("position_embeddings.weight"):
        return (
            f"the learned position table differs (checkpoint {saved[0]} positions, this run "
            f"{expected[0]}): pass --max-position-embeddings {saved[0]} (it defaults to "
            f"--seq-length) with a --seq-length of at most {saved[0]}"
        )
    return (
        "check the model-size flags (--hidden-size, --ffn-hidden-size, --num-attention-heads, "
        "--num-query-groups, --kv-channels) against the checkpoint's metadata.json 'args'"
    )


def check_shapes(
    saved: dict[str, tuple], expected: dict[str, tuple], *, source: str, saved_flags: dict
) -> None:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: parameters do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); the checkpoint is of another architecture."
        )
    differ = [name for name, shape in expected.items() if saved[name] != shape]
    if differ:
        name, shape = differ[0], expected[differ[0]]
        more = f" ({len(differ) - 1} more parameters differ)" if len(differ) > 1 else ""
        raise CheckpointError(
            f"{source}: {name} has shape {saved[name]} in the checkpoint, the model "
            f"expects {shape}{more}; {_shape_fix(name, saved[name], shape, saved_flags)}."
        )


def check_saved_param_shapes(metadata: dict, run: ModelAndOptimizer, *, directory: str) -> None:
    """metadata.json's param shapes against the model, before any tensor is read (checkpoints
    from before shapes were recorded skip this; model.pt's own shapes are still checked)."""
    if "param_shapes" not in metadata:
        return
    source = os.path.join(directory, "metadata.json")
    try:
        saved = {
            name: tuple(int(d) for d in shape) for name, shape in metadata["param_shapes"].items()
        }
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(
            f"{source}: 'param_shapes' is not {{name: [sizes]}}; the file is corrupt or was "
            "edited. Load another iteration."
        ) from None
    expected = checkpoint_param_shapes(run.module)
    check_shapes(saved, expected, source=source, saved_flags=saved_run_flags(metadata))


# LRScheduleConfig fields, by the flag that sets each (for the mismatch message).
_SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_iters": "--lr-warmup-iters (or --lr-warmup-fraction)",
    "warmup_init": "--lr-warmup-init",
    "decay_iters": "--lr-decay-iters (default --train-iters)",
    "decay_style": "--lr-decay-style",
    "wsd_decay_iters": "--lr-wsd-decay-iters",
    "wsd_decay_style": "--lr-wsd-decay-style",
}


def schedule_mismatch(differences: list[tuple], *, directory: str) -> CheckpointError:
    """The error for a schedule whose flags differ from the checkpoint's: (field, saved, now)
    per difference, named by the flag that sets it."""
    listed = "; ".join(
        f"{_SCHEDULE_FLAGS.get(name, name)}: saved {saved!r}, now {now!r}"
        for name, saved, now in differences
    )
    return CheckpointError(
        f"{directory}: the learning-rate schedule differs from the checkpoint's "
        f"({listed}). Pass the saved values, or --override-opt_param-scheduler to use "
        "this run's flags, or --use-checkpoint-opt_param-scheduler to keep the "
        "checkpoint's schedule."
    )
