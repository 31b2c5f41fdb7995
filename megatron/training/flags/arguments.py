"""Every command-line flag of pretrain_gpt.py, and `parse_args`.

Flag names follow Megatron-LM. `parse_args` exits with status 2 and a message that names the flags
and the fix for any invalid combination (the checks are in checks.py), before any model
is built.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.distributed.fsdp.config import OUTER_SHARDING_STRATEGIES, SHARDING_STRATEGIES
from megatron.core.environment import env_int
from megatron.core.fp8.config import FP8_RECIPES
from megatron.core.tokenizer.build import TOKENIZER_TYPES
from megatron.training.flags.checkpoint_args import load_args_from_checkpoint
from megatron.training.flags.checks import ArgumentError, validate_args
from megatron.training.flags.compile import add_compile_args
from megatron.training.flags.fp8_stats import add_fp8_stats_args
from megatron.training.flags.megatron_lm import add_megatron_lm_args
from megatron.training.flags.megatron_lm_table import add_megatron_lm_table_args
from megatron.training.flags.mla import add_mla_args
from megatron.training.flags.moe import add_moe_args
from megatron.training.flags.mup import add_mup_args
from megatron.training.flags.optimizer import add_optimizer_state_args
from megatron.training.flags.recompute import add_recompute_args
from megatron.training.flags.tensor_parallel import add_tensor_parallel_args


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
        help="Share key/value heads (--num-query-groups, default 1, as in Megatron-LM).",
    )
    group.add_argument(
        "--num-query-groups", type=int, default=None, help="Key/value heads under GQA only."
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
    group.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Optimizer steps to run (default 100, or derived from --train-samples).",
    )
    group.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Samples to train on instead of --train-iters: train_samples // global batch size "
        "iterations; the schedule is then given in samples (--lr-decay-samples ...).",
    )
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
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM (e.g. Slurm's --signal before a time limit or preemption), finish the "
        "iteration, save (with --save) and exit with status 0; all ranks stop at the same "
        "iteration.",
    )
    group.add_argument(
        "--backward-worker-threads",
        action="store_true",
        help="Run backward on the autograd engine's per-device worker thread (PyTorch's "
        "default). Without it backward runs on the training loop's own thread, which saves a "
        "thread hand-off per backward pass (measured in "
        "docs/benchmarks/fp8_linear_host_path_h200_2026-12-01.md).",
    )
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Stop the run, before any checkpoint of that state, when the loss or the grad "
        "norm of an iteration is NaN or Inf (Megatron-LM's default). With "
        "--no-check-for-nan-in-loss-and-grad such an iteration skips its update and is counted "
        "in the log's skipped (and, for a NaN loss, nan) iterations.",
    )
    add_compile_args(group)
    group.add_argument("--log-interval", type=int, default=100, help="Iterations per log line.")
    group.add_argument("--eval-interval", type=int, default=1000, help="Iterations per eval.")
    group.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation.")
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
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warmup length as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    group.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="Learning rate warmup starts from."
    )
    group.add_argument(
        "--lr-decay-iters", type=int, default=None, help="Decay length (default --train-iters)."
    )
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD annealing length.")
    group.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="With --train-samples: decay length in samples (default --train-samples).",
    )
    group.add_argument(
        "--lr-warmup-samples", type=int, default=0, help="With --train-samples: warmup samples."
    )
    group.add_argument(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="With --train-samples: WSD annealing length in samples.",
    )
    group.add_argument(
        "--lr-wsd-decay-style",
        choices=("linear", "cosine", "exponential", "minus_sqrt"),
        default="exponential",
        help="WSD annealing shape.",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    group.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="Iterations between per-iteration TensorBoard/W&B points (loss, learning rate, grad "
        "norm, batch size, and their 'vs samples' series); timing, throughput and memory are "
        "logged every --log-interval.",
    )
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
    for flag, text in (
        ("--no-load-optim", "Do not load optimizer."),
        ("--no-load-rng", "Do not load RNG states."),
        (
            "--no-save-optim",
            "Save no optimizer state (smaller checkpoints; resume then needs --no-load-optim).",
        ),
        ("--no-save-rng", "Save no RNG states (resume then needs --no-load-rng)."),
        ("--finetune", "Load model weights only; reset iteration, optimizer and RNG."),
        (
            "--use-checkpoint-args",
            "Take the model flags (sizes, heads, norm, position embeddings, vocabulary rows) "
            "from the --load checkpoint's saved args instead of the command line (Megatron-LM's "
            "flag); each flag it changes is logged.",
        ),
        (
            "--override-opt_param-scheduler",
            "On resume, use this run's learning-rate flags instead of the checkpoint's.",
        ),
        (
            "--use-checkpoint-opt_param-scheduler",
            "On resume, use the checkpoint's learning-rate schedule instead of the flags.",
        ),
    ):
        group.add_argument(flag, action="store_true", help=text)
    group.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="Resume from this iteration's checkpoint under --load instead of the one that "
        "latest_checkpointed_iteration.txt names (Megatron-LM's flag).",
    )
    group.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist", "fsdp_dtensor"),
        default=None,
        help="torch: one file set on rank 0 (default under DDP); torch_dist: sharded with "
        "torch.distributed.checkpoint, loadable at any data-parallel size and under any engine "
        "(DDP, Megatron-FSDP or FSDP2; default with Megatron-FSDP, FSDP2, TP > 1 or EP > 1); "
        "fsdp_dtensor: Megatron-FSDP's name for it (needs --use-megatron-fsdp).",
    )
    group.add_argument(
        "--async-save",
        action="store_true",
        help="Write checkpoints in a background thread from a CPU copy while training goes on; "
        "the tracker names the iteration only once every rank's write completed. Needs "
        "--ckpt-format torch_dist or fsdp_dtensor.",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Prefix of a .bin/.idx pair, or weighted prefixes: 0.75 a 0.25 b.",
    )
    group.add_argument(
        "--split",
        default="969,30,1",
        help="Train,valid,test document shares (quotes around it, as Megatron-LM's example "
        "scripts leave in, are dropped).",
    )
    group.add_argument("--mock-data", action="store_true", help="Synthetic tokens, no files.")
    group.add_argument("--data-cache-path", default=None, help="Where index caches go.")
    group.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="ByteTokenizer",
        help="Tokenizer (ByteTokenizer needs no files).",
    )
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer vocabulary; TikTokenizer's size with its special tokens (2**17).",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFace tokenizer.json (or its directory), TikTokenizer JSON vocabulary, or "
        "SentencePiece .model file.",
    )
    group.add_argument(
        "--tiktoken-pattern",
        choices=("v1", "v2"),
        default=None,
        help="TikTokenizer split regex: Megatron-LM's v1 or v2.",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved for special tokens before the vocabulary.",
    )
    group.add_argument(
        "--tiktoken-special-tokens",
        nargs="+",
        default=None,
        help="TikTokenizer special tokens; must include <unk> <s> </s> (the default).",
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
        default=None,
        help="What is sharded: nothing, optimizer, +grads, +params (ZeRO-3). Default "
        "optim_grads_params with --use-megatron-fsdp, optim with --use-distributed-optimizer.",
    )
    group.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Prefetch the next unit's gather (Megatron-FSDP or --use-distributed-optimizer).",
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
        "--main-params-dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="Main-param dtype; fp16 (Megatron-LM's) needs --use-precision-aware-optimizer "
        "and Megatron-FSDP without FP8 parameters.",
    )
    group.add_argument(
        "--main-grads-dtype",
        choices=("fp32", "bf16", "fp64"),
        default="fp32",
        help="Megatron-FSDP grad-buffer dtype. fp64 (ours, not Megatron-LM's): grads are "
        "accumulated, reduced and normed in fp64 and rounded to fp32 once, so the losses do not "
        "depend on the data-parallel layout (HSDP or ZeRO-3, any DP size at a fixed micro-batch "
        "size), at twice the grad memory and reduce bytes.",
    )
    group.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="Reduce grads across data-parallel ranks in bf16 (Megatron-FSDP's reduce-scatter, "
        "or DDP's all-reduce through a bf16 compression hook).",
    )
    group.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Build on the meta device and materialize shard by shard.",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Number of copies of the sharded state across the data-parallel domain (HSDP): "
        "each of N replicas shards over DP/N consecutive ranks (one node under torchrun/Slurm) "
        "and only grads cross replicas. Default 1: shard over all DP ranks.",
    )
    group.add_argument(
        "--outer-dp-sharding-strategy",
        choices=OUTER_SHARDING_STRATEGIES,
        default="no_shard",
        help="HSDP: what is sharded across the replicas. no_shard: all-reduce grads across "
        "them; optim: also split the optimizer state across them (reduce-scatter grads, "
        "all-gather updated params). Needs --num-distributed-optimizer-instances > 1.",
    )


def _add_fp8_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FP8")
    group.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid", "e5m2"),
        default=None,
        help="Train the transformer Linears in FP8 (Megatron-LM's switch). hybrid: E4M3 "
        "forward, E5M2 grads; e4m3 everywhere. Default: off, or hybrid when --fp8-recipe is "
        "given alone.",
    )
    group.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default=None,
        help="FP8 scaling recipe; with --fp8-format and no recipe, delayed (Megatron-LM's "
        "default). Given alone it also turns FP8 on, in the hybrid format.",
    )
    group.add_argument("--fp8-margin", type=int, default=0, help="Delayed-scaling margin.")
    group.add_argument(
        "--fp8-amax-history-len",
        type=int,
        default=1,
        help="Delayed-scaling history length (Megatron-LM's default 1).",
    )
    group.add_argument(
        "--fp8-amax-compute-algo",
        choices=("max", "most_recent"),
        default="most_recent",
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
        "--fp8-wgrad-input-from-activation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="megatron-fp8's own (not in Megatron-LM); on by default with --fp8-recipe: fc2's "
        "wgrad re-quantizes its input in backward from fc1's output, which SwiGLU/GeLU keep "
        "anyway, instead of keeping an FP8 copy of it from forward. Less memory at the peak "
        "(one byte per element of fc2's input, plus its scales) for one more elementwise pass "
        "and quantization per layer (Model A: 0.88 GiB less, 1-2%% slower; docs/PERFORMANCE.md); "
        "the same bytes either way. --no-fp8-wgrad-input-from-activation keeps the copy.",
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
        message += _guesses(message, self._option_string_actions)
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def _guesses(message: str, actions: dict) -> str:
    """'; did you mean --x for --y?' for unrecognized flags near a known one (listed flags
    first: a hidden Megatron-LM table flag may be one refused as not built), else ''."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    flags = [flag for flag in actions if flag.startswith("--")]
    listed = [flag for flag in flags if actions[flag].help != argparse.SUPPRESS]
    guesses = []
    for flag in (token.split("=", 1)[0] for token in message.split(": ", 1)[1].split()):
        close = [
            difflib.get_close_matches(flag, names, n=1, cutoff=0.8) for names in (listed, flags)
        ]
        if flag.startswith("--") and flag not in actions and (close[0] or close[1]):
            guesses.append(f"{(close[0] or close[1])[0]} for {flag}")  # not a value or after --
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT with megatron-fp8.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # every flag's help shows it
    )
    for add in (
        _add_model_args,
        _add_training_args,
        _add_optimizer_args,
        add_optimizer_state_args,
        _add_logging_args,
        _add_checkpoint_args,
        _add_data_args,
        _add_fsdp_args,
        _add_fp8_args,
        add_fp8_stats_args,
        add_moe_args,
        add_tensor_parallel_args,
        add_megatron_lm_args,
        add_mup_args,
        add_mla_args,
        add_recompute_args,
    ):
        add(parser)
    add_megatron_lm_table_args(parser)  # last: the Megatron-LM flags no group above defines
    return parser


def parse_args(
    argv: Sequence[str] | None = None, *, world_size: int | None = None
) -> argparse.Namespace:
    """Parse and validate for `world_size` ranks (default: the launcher's); on any problem exit
    with status 2 and a message naming the fix. The Namespace holds the flags as given (and
    their defaults); configs.build_run_config resolves the values derived from them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        try:
            changed = load_args_from_checkpoint(args)
        except CheckpointError as error:
            parser.error(str(error))
        if env_int("RANK", 0) == 0:
            for line in changed:
                print(f" > --use-checkpoint-args: {line}", flush=True)
    try:
        validate_args(args, world_size=world_size)
    except ArgumentError as error:
        parser.error(str(error))
    return args
