"""Every command-line flag, and all cross-flag validation in one function.

Flag names follow Megatron-LM. `parse_args` exits with status 2 and a message that names the flags
and the fix for any invalid combination, before any model is built.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from typing import NoReturn

from megatron.core.distributed.fsdp.config import SHARDING_STRATEGIES
from megatron.core.fp8.config import FP8_RECIPES
from megatron.training.path_checks import check_input_file, check_output_dir


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=2, help="Transformer layers.")
    group.add_argument("--hidden-size", type=int, default=128, help="Residual stream width.")
    group.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP inner width (default 4x hidden)."
    )
    group.add_argument("--num-attention-heads", type=int, default=4, help="Query heads.")
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Share key/value heads between groups of query heads (needs --num-query-groups).",
    )
    group.add_argument(
        "--num-query-groups", type=int, default=None, help="Key/value heads under GQA."
    )
    group.add_argument(
        "--kv-channels", type=int, default=None, help="Head width (default hidden / heads)."
    )
    group.add_argument("--seq-length", type=int, default=128, help="Tokens per sample.")
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Rows of the learned position table (default --seq-length).",
    )
    group.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="Learned absolute positions or rotary embeddings.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="RoPE frequency base.")
    group.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head dims that rotate."
    )
    group.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default="LayerNorm",
        help="Pre-norm flavour.",
    )
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of every norm.")
    group.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU.")
    group.add_argument(
        "--disable-bias-linear", action="store_true", help="No biases in transformer Linears."
    )
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Residual dropout.")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Attention-probability dropout."
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-head weight instead of the embedding table.",
    )
    group.add_argument("--init-method-std", type=float, default=0.02, help="Init std.")
    group.add_argument("--bf16", action="store_true", help="bf16 params and compute.")
    group.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="Activation recompute: whole layers or the attention core only.",
    )
    group.add_argument(
        "--recompute-num-layers",
        type=int,
        default=1,
        help="Layers per checkpointed chunk with --recompute-granularity full.",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary (embedding rows) to a multiple of this.",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=4, help="Samples per micro-batch.")
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (default micro-batch x data-parallel size).",
    )
    group.add_argument("--train-iters", type=int, default=100, help="Optimizer steps to run.")
    group.add_argument("--seed", type=int, default=1234, help="Seed of init, data and dropout.")
    group.add_argument(
        "--exit-interval", type=int, default=None, help="Exit when iteration %% N == 0."
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="Save (with --save) and exit after this many minutes of training.",
    )
    group.add_argument("--log-interval", type=int, default=10, help="Iterations per log line.")
    group.add_argument("--eval-interval", type=int, default=1000, help="Iterations per eval.")
    group.add_argument("--eval-iters", type=int, default=10, help="Batches per evaluation.")
    group.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="Collective backend (default nccl when CUDA is available, else gloo on CPU).",
    )


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimizer and schedule")
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="AdamW/SGD.")
    group.add_argument("--lr", type=float, default=3e-4, help="Peak learning rate.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning-rate floor.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled decay.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    group.add_argument(
        "--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0 disables)."
    )
    group.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine", "WSD"),
        default="linear",
        help="Decay after warmup.",
    )
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    group.add_argument(
        "--lr-decay-iters", type=int, default=None, help="Decay length (default --train-iters)."
    )
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD annealing length.")
    group.add_argument(
        "--lr-wsd-decay-style",
        choices=("linear", "cosine", "exponential", "minus_sqrt"),
        default="exponential",
        help="WSD annealing shape.",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    group.add_argument("--wandb-project", default=None, help="Log to this W&B project.")
    group.add_argument("--wandb-exp-name", default=None, help="W&B run name.")
    group.add_argument(
        "--wandb-save-dir", default=None, help="W&B files directory (offline without a key)."
    )


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="Directory to write checkpoints to.")
    group.add_argument("--load", default=None, help="Directory to resume from.")
    group.add_argument("--save-interval", type=int, default=None, help="Iterations per save.")
    group.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer.")
    group.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load model weights only; reset iteration, optimizer and RNG.",
    )
    group.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist"),
        default=None,
        help="torch: one file set on rank 0; torch_dist: sharded (default with Megatron-FSDP).",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Prefix of a .bin/.idx pair, or weighted prefixes: 0.75 a 0.25 b.",
    )
    group.add_argument("--split", default="969,30,1", help="Train,valid,test document shares.")
    group.add_argument("--mock-data", action="store_true", help="Synthetic tokens, no files.")
    group.add_argument("--data-cache-path", default=None, help="Where index caches go.")
    group.add_argument(
        "--tokenizer-type",
        choices=("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"),
        default="ByteTokenizer",
        help="Tokenizer (ByteTokenizer needs no files).",
    )
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary.")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFace tokenizer.json, or the directory that holds it.",
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json path.")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt path.")
    group.add_argument(
        "--reset-position-ids", action="store_true", help="Restart positions after each EOD."
    )
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")


def _add_fsdp_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-FSDP")
    group.add_argument(
        "--use-megatron-fsdp", action="store_true", help="Shard with our Megatron-FSDP engine."
    )
    group.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default="optim_grads_params",
        help="What is sharded: nothing, optimizer, +grads, +params (ZeRO-3).",
    )
    group.add_argument(
        "--overlap-param-gather", action="store_true", help="Prefetch the next unit's gather."
    )
    group.add_argument(
        "--overlap-grad-reduce", action="store_true", help="Reduce-scatter grads asynchronously."
    )
    group.add_argument(
        "--suggested-communication-unit-size",
        type=int,
        default=None,
        help="Cap, in elements, on parameters gathered ahead at once.",
    )
    group.add_argument(
        "--main-params-dtype", choices=("fp32",), default="fp32", help="Main-param dtype."
    )
    group.add_argument(
        "--main-grads-dtype", choices=("fp32", "bf16"), default="fp32", help="Grad dtype."
    )
    group.add_argument(
        "--grad-reduce-in-bf16", action="store_true", help="Reduce-scatter grads in bf16."
    )
    group.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Build on the meta device and materialize shard by shard.",
    )


def _add_fp8_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FP8")
    group.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid", "e5m2"),
        default=None,
        help="hybrid: E4M3 forward, E5M2 grads; e4m3 everywhere (default hybrid with a recipe).",
    )
    group.add_argument(
        "--fp8-recipe", choices=FP8_RECIPES, default=None, help="FP8 scaling recipe."
    )
    group.add_argument("--fp8-margin", type=int, default=0, help="Delayed-scaling margin.")
    group.add_argument(
        "--fp8-amax-history-len", type=int, default=1024, help="Delayed-scaling history length."
    )
    group.add_argument(
        "--fp8-amax-compute-algo",
        choices=("max", "most_recent"),
        default="max",
        help="Delayed scaling: amax from the history max or the newest entry.",
    )
    group.add_argument(
        "--fp8-power-2-scale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Round scales down to powers of two (default: on for blockwise).",
    )
    group.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="Keep weights only in FP8 (plus fp32 main shards); gather FP8 bytes.",
    )
    group.add_argument(
        "--first-last-layers-bf16",
        action="store_true",
        help="Keep the first/last layers in high precision (see the two counts below).",
    )
    group.add_argument(
        "--num-layers-at-start-in-bf16", type=int, default=1, help="Leading bf16 layers."
    )
    group.add_argument(
        "--num-layers-at-end-in-bf16", type=int, default=1, help="Trailing bf16 layers."
    )


class _Parser(argparse.ArgumentParser):
    """Prints only the error (the full usage of ~100 flags would bury it), then exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT with megatron-fp8.",
        allow_abbrev=False,
    )
    for add in (
        _add_model_args,
        _add_training_args,
        _add_optimizer_args,
        _add_logging_args,
        _add_checkpoint_args,
        _add_data_args,
        _add_fsdp_args,
        _add_fp8_args,
    ):
        add(parser)
    return parser


def world_size_from_env() -> int:
    """Data-parallel size as torchrun/Slurm announce it (1 for a plain `python` launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(
    argv: Sequence[str] | None = None, *, world_size: int | None = None
) -> argparse.Namespace:
    """Parse and validate; on any problem exit with status 2 and a message naming the fix."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.world_size = world_size if world_size is not None else world_size_from_env()
    args.data_parallel_size = args.world_size
    try:
        validate_args(args)
    except ArgumentError as error:
        parser.error(str(error))
    return args


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""


def validate_args(args: argparse.Namespace) -> None:
    """All cross-flag checks, in one place. Fills derived defaults. Raises ArgumentError."""
    _validate_batch(args)
    _validate_model(args)
    _validate_schedule(args)
    _validate_data(args)
    _validate_checkpointing(args)
    _validate_fsdp(args)
    _validate_fp8(args)
    _validate_output_dirs(args)
    _validate_logging(args)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


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


def _validate_batch(args: argparse.Namespace) -> None:
    dp = args.data_parallel_size
    _require(args.micro_batch_size > 0, "--micro-batch-size must be positive.")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    _require(
        args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
        f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
        f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}; set "
        f"--global-batch-size to a multiple of {per_step} or change --micro-batch-size.",
    )
    args.num_microbatches = args.global_batch_size // per_step
    _require(args.train_iters > 0, "--train-iters must be positive.")
    _require(args.log_interval > 0, "--log-interval must be positive.")
    _require(args.eval_interval > 0, "--eval-interval must be positive.")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0 (0 disables evaluation).")
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, "--exit-interval must be positive.")
    if args.exit_duration_in_mins is not None:
        _require(args.exit_duration_in_mins > 0, "--exit-duration-in-mins must be positive.")


def _validate_model(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} must be positive.")
    if args.kv_channels is None:
        _require(
            args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; change one of them or set --kv-channels.",
        )
    if args.group_query_attention:
        _require(
            args.num_query_groups is not None,
            "--group-query-attention needs --num-query-groups N (key/value heads).",
        )
    elif args.num_query_groups is not None:
        raise ArgumentError("--num-query-groups needs --group-query-attention.")
    if args.num_query_groups is not None:
        _require(
            args.num_query_groups > 0 and args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not a multiple of "
            f"--num-query-groups {args.num_query_groups}; pick a divisor.",
        )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
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
    _require(args.recompute_num_layers > 0, "--recompute-num-layers must be positive.")
    _require(
        args.make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be positive."
    )


def _validate_schedule(args: argparse.Namespace) -> None:
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require_positive(args, "lr", "the default is 3e-4")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}].")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0.")
    _require(
        args.lr_decay_iters > 0, "--lr-decay-iters must be positive (omit it for --train-iters)."
    )
    if args.lr_decay_style != "constant":
        _require(
            args.lr_warmup_iters < args.lr_decay_iters,
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters "
            f"{args.lr_decay_iters}; shorten warmup or lengthen the decay.",
        )
    if args.lr_decay_style == "WSD":
        _require(
            args.lr_wsd_decay_iters is not None,
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (length of the annealing phase).",
        )
        _require(
            0 < args.lr_wsd_decay_iters <= args.lr_decay_iters - args.lr_warmup_iters,
            "--lr-wsd-decay-iters must be positive and fit after warmup within --lr-decay-iters.",
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
    }.get(args.tokenizer_type, [])
    for attr, flag in needs:
        value = getattr(args, attr)
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
            args.tokenizer_type == "NullTokenizer",
            f"--vocab-size sets the NullTokenizer vocabulary only; --tokenizer-type "
            f"{args.tokenizer_type} takes its size from the tokenizer: drop --vocab-size or "
            "use --tokenizer-type NullTokenizer.",
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
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive.")
        _require(args.save is not None, "--save-interval needs --save DIR.")
    if args.ckpt_format is None:
        args.ckpt_format = "torch_dist" if args.use_megatron_fsdp else "torch"
    if args.ckpt_format == "torch_dist":
        _require(
            args.use_megatron_fsdp,
            "--ckpt-format torch_dist is the sharded format of Megatron-FSDP; add "
            "--use-megatron-fsdp or use --ckpt-format torch.",
        )
    else:
        # The torch format saves replicated main params; Megatron-FSDP holds only shards.
        _require(
            not args.use_megatron_fsdp,
            "--use-megatron-fsdp saves sharded checkpoints: drop --ckpt-format torch (the "
            "default with Megatron-FSDP is torch_dist, which also resumes at another "
            "data-parallel size).",
        )


def _validate_fsdp(args: argparse.Namespace) -> None:
    if args.use_megatron_fsdp:
        if args.suggested_communication_unit_size is not None:
            _require(
                args.suggested_communication_unit_size > 0,
                "--suggested-communication-unit-size must be positive.",
            )
        return
    fsdp_only = {
        "overlap_param_gather": "--overlap-param-gather",
        "init_model_with_meta_device": "--init-model-with-meta-device",
        "grad_reduce_in_bf16": "--grad-reduce-in-bf16",
        "suggested_communication_unit_size": "--suggested-communication-unit-size",
    }
    for attr, flag in fsdp_only.items():
        _require(
            not getattr(args, attr), f"{flag} is a Megatron-FSDP option; add --use-megatron-fsdp."
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
    if args.wandb_project and args.wandb_save_dir is None and args.save is not None:
        args.wandb_save_dir = os.path.join(args.save, "wandb")  # Megatron-LM's default
    if not (args.tensorboard_dir or args.wandb_project):
        return
    from megatron.training.loggers import check_logger_settings

    try:
        check_logger_settings(
            tensorboard_dir=args.tensorboard_dir,
            wandb_project=args.wandb_project,
            wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir,
        )
    except (ValueError, ImportError) as error:
        raise ArgumentError(str(error)) from None


def _validate_fp8(args: argparse.Namespace) -> None:
    if args.fp8_format == "e5m2":
        raise ArgumentError(
            "--fp8-format e5m2: E5M2 alone is not allowed (E5M2 x E5M2 GEMMs are not supported); "
            "use --fp8-format hybrid (E4M3 forward, E5M2 grads) or e4m3."
        )
    if args.fp8_recipe is None:
        _require(
            args.fp8_format is None,
            f"--fp8-format {args.fp8_format} needs --fp8-recipe "
            "delayed|tensorwise|blockwise|mxfp8.",
        )
        for flag, on in (
            ("--fp8-param-gather", args.fp8_param_gather),
            ("--first-last-layers-bf16", args.first_last_layers_bf16),
        ):
            _require(not on, f"{flag} needs --fp8-recipe delayed|tensorwise|blockwise|mxfp8.")
        return
    if args.fp8_format is None:
        args.fp8_format = "hybrid"
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
            "--use-megatron-fsdp.",
        )
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        _require(
            start >= 0 and end >= 0 and start + end < args.num_layers,
            f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} must "
            f"leave at least one of --num-layers {args.num_layers} in FP8.",
        )
