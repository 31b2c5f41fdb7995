"""Cross-flag validation of pretrain_gpt.py's arguments: every check in one function.

`validate_args` checks the flags as configs.resolved_flags resolves them (without storing that
copy) and raises ArgumentError, whose message names the flags and the fix;
`arguments.parse_args` turns it into exit status 2 before any model is built.
"""

from __future__ import annotations

import argparse
import math

import torch

from megatron.core.transformer.moe.config_checks import check_moe_config
from megatron.training.checkpoint.path_checks import check_input_file, check_output_dir
from megatron.training.flags import configs
from megatron.training.flags.megatron_lm import unbuilt_features
from megatron.training.flags.megatron_lm_checks import validate_megatron_lm_args
from megatron.training.flags.moe import validate_moe_world
from megatron.training.flags.optimizer import validate_optimizer_args
from megatron.training.flags.tensor_parallel import validate_tensor_parallel_args
from megatron.training.loggers import check_logger_settings


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""


def validate_args(args: argparse.Namespace, *, world_size: int | None = None) -> None:
    """All cross-flag checks, in one place, of the flags as given (`args`, left unchanged) and
    as configs.resolved_flags resolves them for `world_size` ranks. Raises ArgumentError."""
    # First: a command line that asks for features we have not built gets one message naming
    # all of them, before any other check.
    unbuilt = unbuilt_features(args)
    if unbuilt is not None:
        raise ArgumentError(unbuilt)
    try:
        flags = configs.resolved_flags(args, world_size=world_size)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    # First the TP layout: the batch checks divide by the data-parallel size, world / TP.
    _as_argument_error(validate_tensor_parallel_args, flags)
    _validate_batch(flags, given=args)
    _validate_model(flags)
    _as_argument_error(_validate_moe, flags)
    _validate_schedule(flags)
    _as_argument_error(validate_megatron_lm_args, flags)
    _validate_data(flags)
    _validate_checkpointing(flags)
    _validate_backend(flags)
    _validate_fsdp(flags)
    _validate_fp8(flags, given=args)
    _as_argument_error(validate_optimizer_args, flags)
    _validate_output_dirs(args)
    _validate_logging(flags)


def _as_argument_error(check, flags: argparse.Namespace) -> None:
    """A check module's ValueError as an ArgumentError (one `error:` line, exit 2)."""
    try:
        check(flags)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def _require_each_positive(args: argparse.Namespace, *names: str, optional: bool = False) -> None:
    """Each flag (by attribute name) > 0; with `optional`, also unset (None)."""
    for name in names:
        value = getattr(args, name)
        if not (optional and value is None):
            _require(value > 0, f"--{name.replace('_', '-')} must be positive.")


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _require_positive(args: argparse.Namespace, attr: str, hint: str) -> None:
    """A given value (None: derived later) must be finite and > 0; hint says what to pass."""
    value = getattr(args, attr)
    if value is not None:
        _require(math.isfinite(value) and value > 0, f"{_flag(attr)} {value} must be > 0; {hint}.")


def _require_fraction(args: argparse.Namespace, attr: str, hint: str) -> None:
    value = getattr(args, attr)
    _require(0.0 <= value < 1.0, f"{_flag(attr)} {value} must be in [0, 1); {hint}.")


# Sizes and scales that are silently wrong (a zero-width layer, NaN loss) or raise raw torch
# errors when <= 0, each with the fix its message names.
_POSITIVE_MODEL_VALUES = (
    ("ffn_hidden_size", "omit it for 4 x --hidden-size"),
    ("kv_channels", "omit it for --hidden-size / --num-attention-heads"),
    ("max_position_embeddings", "omit it for --seq-length"),
    ("rotary_base", "Megatron's default is 10000"),
    ("norm_epsilon", "the default is 1e-5"),
    ("init_method_std", "the default is 0.02"),
)


def _validate_batch(args: argparse.Namespace, *, given: argparse.Namespace) -> None:
    dp = args.data_parallel_size
    _require(args.micro_batch_size > 0, "--micro-batch-size must be positive.")
    per_step = args.micro_batch_size * dp
    _require(
        args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
        f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
        f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}; set "
        f"--global-batch-size to a multiple of {per_step} or change --micro-batch-size.",
    )
    if args.train_samples is not None:
        # Megatron-LM: the run length is given one way or the other, and the iterations are
        # the whole global batches the samples make.
        _require(
            given.train_iters is None,
            "--train-iters and --train-samples both set the run length; pass only one.",
        )
        _require(
            args.train_samples >= args.global_batch_size,
            f"--train-samples {args.train_samples} is less than one global batch "
            f"({args.global_batch_size}); train on more samples or a smaller batch.",
        )
    _require_each_positive(args, "train_iters", "log_interval", "tensorboard_log_interval")
    _require_each_positive(args, "log_fp8_stats_interval")
    _require(
        args.eval_interval > 0,
        "--eval-interval must be positive; to turn evaluation off, give --eval-iters 0.",
    )
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0 (0 disables evaluation).")
    _require_each_positive(args, "exit_interval", "exit_duration_in_mins", optional=True)


def _validate_model(args: argparse.Namespace) -> None:
    _require_each_positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    if args.kv_channels is None:
        _require(
            args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; change one of them or set --kv-channels.",
        )
    # --group-query-attention alone: one group; --num-query-groups alone: ignored (configs.py).
    if args.group_query_attention and args.num_query_groups is not None:
        _require(
            args.num_query_groups > 0 and args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not a multiple of "
            f"--num-query-groups {args.num_query_groups}; pick a divisor.",
        )
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise the latter.",
        )
    for attr, hint in _POSITIVE_MODEL_VALUES:
        _require_positive(args, attr, hint)
    for attr in ("hidden_dropout", "attention_dropout"):
        _require_fraction(args, attr, "0 disables it")
    _require(0.0 < args.rotary_percent <= 1.0, "--rotary-percent must be in (0, 1].")
    _require(
        args.make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be positive."
    )


def _validate_moe(args: argparse.Namespace) -> None:
    """MoE: the rules of moe/config_checks.py on the config these flags build, and the
    expert-parallel size against the world size."""
    validate_moe_world(args)
    if args.num_experts is not None or args.expert_model_parallel_size != 1:
        check_moe_config(configs.model_template(args))


def _schedule_flags_given(args: argparse.Namespace, unit: str) -> list[str]:
    """The --lr-{decay,warmup,wsd-decay}-{unit} flags (unit: iters or samples) this run sets."""
    defaults = {"decay": None, "warmup": 0, "wsd_decay": None}
    return [
        f"--lr-{name.replace('_', '-')}-{unit}"
        for name, default in defaults.items()
        if getattr(args, f"lr_{name}_{unit}") != default
    ]


def _check_schedule_units(args: argparse.Namespace) -> None:
    """--train-samples runs give the schedule in samples (Megatron-LM), --train-iters runs in
    iterations; configs.lr_lengths converts samples to iterations."""
    iteration_flags = _schedule_flags_given(args, "iters")
    sample_flags = _schedule_flags_given(args, "samples")
    if args.train_samples is None:
        _require(
            not sample_flags,
            f"{', '.join(sample_flags)} go with --train-samples; with --train-iters give the "
            "schedule in iterations (--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters).",
        )
        return
    _require(
        not iteration_flags,
        f"with --train-samples give the schedule in samples: replace {', '.join(iteration_flags)} "
        "by --lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples.",
    )
    for attr in ("lr_decay_samples", "lr_wsd_decay_samples"):
        _require_positive(args, attr, "omit it for the default")
    _require(args.lr_warmup_samples >= 0, "--lr-warmup-samples must be >= 0.")


def _validate_schedule(args: argparse.Namespace) -> None:
    """The schedule's lengths in iterations are derived in configs.py (lr_lengths), not
    written back into the flags; they are checked here as the scheduler will see them."""
    _check_schedule_units(args)
    warmup, decay, wsd = configs.lr_lengths_before_fraction(args)
    _require_positive(args, "lr", "the default is 3e-4")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}].")
    _require(warmup >= 0, "--lr-warmup-iters must be >= 0.")
    _require(decay > 0, "--lr-decay-iters must be positive (omit it for --train-iters).")
    if args.lr_warmup_fraction is not None:
        # Megatron-LM: warmup = fraction x decay length, and the two warmup flags are exclusive.
        _require(
            warmup == 0,
            "--lr-warmup-fraction and --lr-warmup-iters (or --lr-warmup-samples) both set the "
            "warmup; pass only one.",
        )
        _require(
            math.isfinite(args.lr_warmup_fraction) and 0 <= args.lr_warmup_fraction < 1,
            f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1).",
        )
        warmup = args.lr_warmup_fraction * decay
    _require(
        math.isfinite(args.lr_warmup_init) and 0 <= args.lr_warmup_init <= args.lr,
        f"--lr-warmup-init {args.lr_warmup_init} must be in [0, --lr {args.lr}].",
    )
    # Name the flags the user gives: the sample ones in a --train-samples run.
    unit = "samples" if args.train_samples is not None else "iters"
    warmup_flag, decay_flag, wsd_flag = (
        f"--lr-{name}-{unit}" for name in ("warmup", "decay", "wsd-decay")
    )
    if args.lr_decay_style != "constant":
        _require(
            warmup < decay,
            f"the warmup ({warmup_flag}, {warmup} iterations) must end before the "
            f"decay does ({decay_flag}, {decay} iterations); shorten warmup or "
            "lengthen the decay.",
        )
    if args.lr_decay_style == "WSD":
        _require(
            wsd is not None,
            f"--lr-decay-style WSD needs {wsd_flag} (length of the annealing phase).",
        )
        _require(
            0 < wsd <= decay - warmup,
            f"{wsd_flag} must be positive and fit after warmup within {decay_flag}.",
        )
    _require(
        math.isfinite(args.clip_grad) and args.clip_grad >= 0,
        f"--clip-grad {args.clip_grad} must be a finite number >= 0 (0 disables clipping).",
    )
    _require(
        math.isfinite(args.weight_decay) and args.weight_decay >= 0,
        f"--weight-decay {args.weight_decay} must be a finite number >= 0 (0 disables decay).",
    )
    _require_fraction(args, "adam_beta1", "the default is 0.9")
    _require_fraction(args, "adam_beta2", "the default is 0.999")
    _require_positive(args, "adam_eps", "the default is 1e-8")
    _require_fraction(args, "sgd_momentum", "0 disables momentum; the default is 0.9")


def _validate_data(args: argparse.Namespace) -> None:
    if args.mock_data:
        _require(not args.data_path, "--mock-data and --data-path exclude each other; pick one.")
    else:
        _require(
            bool(args.data_path),
            "No training data: pass --data-path PREFIX (made by tools/preprocess_data.py) or "
            "--mock-data for synthetic tokens.",
        )
    train_share = _validate_split(args.split)[0]
    # --train-iters is positive (_validate_batch), so the train split needs documents; mock
    # data has no documents to split.
    _require(
        train_share > 0 or args.mock_data,
        f"--split {args.split!r} gives the train split no documents, but --train-iters "
        f"{args.train_iters} needs training data; give the first share a positive weight, like "
        "969,30,1.",
    )
    # numpy's RandomState, which shuffles the data and draws mock samples, takes 32-bit seeds.
    _require(0 <= args.seed < 2**32, f"--seed {args.seed} must be in [0, 2**32).")
    needs = {
        "NullTokenizer": [("vocab_size", "--vocab-size")],
        "HuggingFaceTokenizer": [("tokenizer_model", "--tokenizer-model")],
        "GPT2BPETokenizer": [("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")],
        "TikTokenizer": [("tokenizer_model", "--tokenizer-model"), ("tiktoken_pattern", None)],
        "SentencePieceTokenizer": [("tokenizer_model", "--tokenizer-model")],
        "GPTSentencePieceTokenizer": [("tokenizer_model", "--tokenizer-model")],
    }.get(args.tokenizer_type, [])
    for attr, flag in needs:
        value = getattr(args, attr)
        if flag is None:  # a choice, not a path
            flag = "--" + attr.replace("_", "-")
            _require(value is not None, f"--tokenizer-type {args.tokenizer_type} needs {flag}.")
            continue
        _require(value is not None, f"--tokenizer-type {args.tokenizer_type} needs {flag}.")
        if isinstance(value, str):
            try:
                check_input_file(value, flag=flag)
            except ValueError as error:
                raise ArgumentError(f"{error}.") from None
    if args.vocab_size is not None:
        _require(args.vocab_size > 1, "--vocab-size must be at least 2.")
        # Other tokenizers define their own vocabulary; an ignored --vocab-size would let a
        # run believe it trains with a different one.
        _require(
            args.tokenizer_type in ("NullTokenizer", "TikTokenizer"),
            f"--vocab-size sets the NullTokenizer vocabulary only; --tokenizer-type "
            f"{args.tokenizer_type} takes its size from the tokenizer: drop --vocab-size or "
            "use --tokenizer-type NullTokenizer (or TikTokenizer, whose size it also sets).",
        )
    if args.tokenizer_type == "TikTokenizer":
        _require(
            args.tiktoken_num_special_tokens >= 3,
            "--tiktoken-num-special-tokens must be at least 3 (<unk>, <s>, </s>).",
        )


def _validate_split(split: str) -> list[float]:
    try:
        parts = [float(part) for part in split.replace("/", ",").split(",")]
    except ValueError:
        raise ArgumentError(f"--split {split!r}: expected numbers like 969,30,1.") from None
    _require(
        1 <= len(parts) <= 3
        and all(math.isfinite(part) and part >= 0 for part in parts)
        and sum(parts) > 0,
        f"--split {split!r}: give up to three finite non-negative shares with a positive sum, "
        "like 969,30,1.",
    )
    return parts


def _validate_checkpointing(args: argparse.Namespace) -> None:
    _require(
        not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each "
        "other: pick the flags' schedule or the checkpoint's.",
    )
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive.")
        _require(args.save is not None, "--save-interval needs --save DIR.")
    if args.ckpt_step is not None:
        _require(args.load is not None, "--ckpt-step needs --load DIR (the --save directory).")
        _require(args.ckpt_step > 0, f"--ckpt-step {args.ckpt_step} must be a saved iteration > 0.")
    if args.ckpt_format == "fsdp_dtensor":
        _require(
            args.use_megatron_fsdp,
            "--ckpt-format fsdp_dtensor is Megatron-FSDP's format; add --use-megatron-fsdp, or "
            "use --ckpt-format torch_dist (the same sharded layout, for DDP too).",
        )
    if args.ckpt_format == "torch":
        # The torch format saves replicated main params; Megatron-FSDP and FSDP2 hold only
        # shards (Megatron-LM: '--use-torch-fsdp2 requires --ckpt-format torch_dist').
        engine_flag = (
            "--use-distributed-optimizer (Megatron-FSDP's optim strategy)"
            if args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "optim"
            else "--use-torch-fsdp2"
            if args.use_torch_fsdp2
            else "--use-megatron-fsdp"
        )
        _require(
            not (args.use_megatron_fsdp or args.use_torch_fsdp2),
            f"{engine_flag} saves sharded checkpoints: drop --ckpt-format torch (the "
            "default with Megatron-FSDP and FSDP2 is torch_dist, which also resumes at another "
            "data-parallel size and under the other engine).",
        )
    if args.async_save:
        # As Megatron-LM: only the sharded format has an asynchronous writer.
        _require(
            args.ckpt_format != "torch",
            "--async-save needs --ckpt-format torch_dist (or fsdp_dtensor with "
            "--use-megatron-fsdp); the torch format is written synchronously.",
        )
        _require(args.save is not None, "--async-save needs --save DIR.")


def _validate_hsdp(args: argparse.Namespace) -> None:
    """--num-distributed-optimizer-instances / --outer-dp-sharding-strategy (HSDP)."""
    instances, dp = args.num_distributed_optimizer_instances, args.data_parallel_size
    _require(
        instances >= 1,
        f"--num-distributed-optimizer-instances {instances} must be >= 1 (1: no HSDP).",
    )
    if args.outer_dp_sharding_strategy == "optim":
        _require(
            args.data_parallel_sharding_strategy != "no_shard",
            "--outer-dp-sharding-strategy optim splits the optimizer state across replicas, "
            "but --data-parallel-sharding-strategy no_shard does not shard it inside one; use "
            "--data-parallel-sharding-strategy optim_grads_params (or optim, optim_grads).",
        )
        _require(
            instances > 1,
            "--outer-dp-sharding-strategy optim shards across HSDP replicas; add "
            "--num-distributed-optimizer-instances N (N > 1, e.g. the number of nodes) or "
            "drop it.",
        )
    if instances > 1:
        _require(
            args.use_megatron_fsdp,
            f"--num-distributed-optimizer-instances {instances} builds HSDP replicas of "
            "Megatron-FSDP's sharded state; add --use-megatron-fsdp.",
        )
        _require(
            dp % instances == 0,
            f"--num-distributed-optimizer-instances {instances} does not divide the "
            f"data-parallel size {dp}; pick a divisor of {dp} (typically the number of nodes).",
        )
        _require(
            args.data_parallel_sharding_strategy != "no_shard",
            "--num-distributed-optimizer-instances > 1 replicates a sharded state, but "
            "--data-parallel-sharding-strategy no_shard shards nothing; use optim_grads_params "
            "(or optim, optim_grads).",
        )


def _validate_fsdp(args: argparse.Namespace) -> None:
    _validate_hsdp(args)
    if args.use_megatron_fsdp:
        if args.suggested_communication_unit_size is not None:
            _require(
                args.suggested_communication_unit_size > 0,
                "--suggested-communication-unit-size must be positive.",
            )
        return
    # --grad-reduce-in-bf16 also works with DDP (a bf16 all-reduce hook).
    fsdp_only = {
        "overlap_param_gather": "--overlap-param-gather",
        "init_model_with_meta_device": "--init-model-with-meta-device",
        "suggested_communication_unit_size": "--suggested-communication-unit-size",
    }
    for attr, flag in fsdp_only.items():
        _require(
            not getattr(args, attr),
            f"{flag} is a Megatron-FSDP option; add --use-megatron-fsdp or "
            "--use-distributed-optimizer.",
        )
    _require(
        args.main_grads_dtype == "fp32",
        f"--main-grads-dtype {args.main_grads_dtype} sets Megatron-FSDP's grad buffers; add "
        "--use-megatron-fsdp (DDP and FSDP2 keep fp32 grads).",
    )


def _validate_output_dirs(args: argparse.Namespace) -> None:
    for attr in ("save", "data_cache_path", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, attr)
        if path:
            try:
                check_output_dir(path, flag=_flag(attr))
            except ValueError as error:
                raise ArgumentError(f"{error}.") from None


def _validate_logging(args: argparse.Namespace) -> None:
    if not (args.tensorboard_dir or args.wandb_project):
        return
    try:
        check_logger_settings(
            tensorboard_dir=args.tensorboard_dir,
            wandb_project=args.wandb_project,
            wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir,
        )
    except (ValueError, ImportError) as error:
        raise ArgumentError(str(error)) from None


def _validate_backend(args: argparse.Namespace) -> None:
    if args.distributed_backend == "nccl":
        _require(
            torch.cuda.is_available(),
            "--distributed-backend nccl needs CUDA GPUs and none is visible here; use "
            "--distributed-backend gloo (the default without GPUs).",
        )


def _validate_fp8(args: argparse.Namespace, *, given: argparse.Namespace) -> None:
    if args.fp8_format == "e5m2":
        raise ArgumentError(
            "--fp8-format e5m2: E5M2 alone is not allowed (E5M2 x E5M2 GEMMs are not supported); "
            "use --fp8-format hybrid (E4M3 forward, E5M2 grads) or e4m3."
        )
    if args.fp8_recipe is None:
        for flag, on in (
            ("--fp8-param-gather", args.fp8_param_gather),
            ("--first-last-layers-bf16", args.first_last_layers_bf16),
            ("--fp8-wgrad-input-from-activation", given.fp8_wgrad_input_from_activation),
            ("--log-fp8-stats", args.log_fp8_stats),
        ):
            _require(not on, f"{flag} needs --fp8-recipe delayed|tensorwise|blockwise|mxfp8.")
        return
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    for flag, size in (("--hidden-size", args.hidden_size), ("--ffn-hidden-size", ffn)):
        _require(
            size % 16 == 0,
            f"{flag} {size} is not divisible by 16, which FP8 GEMMs need; pick a multiple of 16 "
            "or drop --fp8-recipe.",
        )
    _require(args.fp8_margin >= 0, "--fp8-margin must be >= 0.")
    _require(args.fp8_amax_history_len > 0, "--fp8-amax-history-len must be positive.")
    if args.fp8_param_gather:
        _require(
            args.use_megatron_fsdp,
            "--fp8-param-gather keeps weights in FP8 inside Megatron-FSDP; add "
            "--use-megatron-fsdp or --use-distributed-optimizer.",
        )
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        _require(
            start >= 0 and end >= 0 and start + end < args.num_layers,
            f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} must "
            f"leave at least one of --num-layers {args.num_layers} in FP8.",
        )
