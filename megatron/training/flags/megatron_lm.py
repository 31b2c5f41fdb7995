"""The Megatron-LM flags its dense GPT recipes use, beyond the core ones in arguments.py.

Three kinds (docs/MEGATRON_LM_FLAGS.md lists every flag and what it does here):
- features, with Megatron-LM's meaning and defaults (distributed optimizer, per-token loss,
  decoupled learning rate, fp16 loss scaling, profiling, manual GC, logging switches ...);
- knobs of code we do not have (TransformerEngine, apex fusions, NCCL user buffers, async
  checkpoint workers): accepted, and the log says once why each given one does not apply;
- features we have not built (pipeline and context parallelism above 1, the flex MoE
  dispatcher, ...): refused at parse time in one message naming every such flag of the line.

Parse-time code, like arguments.py and checks.py: it adds flags to the parser and maps
and checks their values in the argparse Namespace before configs.build_run_config reads it, so
it works on the Namespace; nothing here runs below `pretrain()`.
"""

from __future__ import annotations

import argparse

from megatron.training.flags.megatron_lm_table import unbuilt_table_flags
from megatron.training.flags.moe import unbuilt_moe_features

# Megatron-LM's --dist-ckpt-strictness choices.
_STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)
_FSDP_DTYPES = ("fp32", "bf16", "fp16", "fp64", "auto")


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> None:
    for add in (_add_features, _add_logging, _add_fp16, _add_profiling, _add_knobs, _add_unbuilt):
        add(parser)


def _add_features(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM training features")
    for add in (_add_sharding_and_model, _add_runtime, _add_fsdp_dtypes):
        add(group)


def _add_sharding_and_model(group) -> None:
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the fp32 main params and optimizer state over the data-parallel ranks "
        "(Megatron-LM's distributed optimizer, ZeRO-1). Runs as Megatron-FSDP's 'optim' "
        "strategy; with --use-megatron-fsdp the strategy flag decides. Checkpoints are "
        "torch_dist.",
    )
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard the model with PyTorch's FSDP2 (fully_shard per transformer layer and on the "
        "model; fp32 shards, --bf16 compute, fp32 grad reduce-scatter, bf16 with "
        "--grad-reduce-in-bf16; torch_dist checkpoints). Not with FP8 or --fp16 (use "
        "--use-megatron-fsdp for those).",
    )
    group.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="Zero-centred norm scales: weights start at 0 and the norm multiplies by 1 + w.",
    )
    group.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over all tokens of the global batch (every micro-batch and rank) "
        "instead of averaging per-micro-batch means.",
    )
    group.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="Peak learning rate of the input embedding and output layer weights.",
    )
    group.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="Learning-rate floor of the input embedding and output layer (default --min-lr).",
    )


def _add_runtime(group) -> None:
    group.add_argument(
        "--manual-gc",
        action="store_true",
        help="Turn Python's automatic garbage collector off; collect at evaluation start/end "
        "and every --manual-gc-interval iterations instead (same timing on every rank).",
    )
    group.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="With --manual-gc: iterations between collections (0: only around evaluation).",
    )
    group.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="torch.cuda.empty_cache() after each forward-backward (1) and also after each "
        "optimizer step (2); 0 never. No effect on CPU (the log says so).",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of the process group's collectives (Megatron-LM's default 10).",
    )
    group.add_argument(
        "--num-workers",
        type=int,
        default=2,
        help="Data-loader worker processes in Megatron-LM. Batches are read in the training "
        "process here (an index lookup into memory-mapped files), so it only is validated.",
    )
    group.add_argument(
        "--no-mmap-bin-files",
        action="store_false",
        dest="mmap_bin_files",
        help="Read .bin files without mmap in Megatron-LM. Here they are memory-mapped "
        "(same tokens); the log says so.",
    )


def _add_fsdp_dtypes(group) -> None:
    group.add_argument(
        "--megatron-fsdp-main-params-dtype",
        choices=_FSDP_DTYPES,
        default=None,
        help="Megatron-FSDP main-param dtype (Megatron-LM's name of --main-params-dtype); "
        "only fp32 (or auto with fp32 params) is built.",
    )
    group.add_argument(
        "--megatron-fsdp-main-grads-dtype",
        choices=_FSDP_DTYPES,
        default=None,
        help="Megatron-FSDP grad-buffer dtype (Megatron-LM's name of --main-grads-dtype); "
        "auto: the params' dtype.",
    )
    group.add_argument(
        "--megatron-fsdp-grad-comm-dtype",
        choices=_FSDP_DTYPES,
        default=None,
        help="Megatron-FSDP grad reduce-scatter dtype; bf16 is --grad-reduce-in-bf16, auto the "
        "grad-buffer dtype.",
    )


def _add_logging(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM logging switches")
    group.add_argument(
        "--log-throughput",
        action="store_true",
        help="Throughput per GPU in the log line (always printed here).",
    )
    group.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="Python logging level of the run (10 DEBUG, 20 INFO, 30 WARNING); default INFO "
        "on rank 0 and WARNING elsewhere.",
    )
    group.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Also write forward-backward-time and optimizer-time (seconds) to TensorBoard.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="Megatron-LM's timer detail; the timers here are the level-0 ones (iteration, "
        "forward-backward, optimizer), so every level logs the same.",
    )
    group.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Memory to TensorBoard (mem-allocated-bytes, mem-max-allocated-bytes: always "
        "written here).",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Validation perplexity to TensorBoard (always written here).",
    )
    group.add_argument(
        "--log-params-norm",
        action="store_true",
        help="L2 norm of all fp32 main params in the log line and TensorBoard (params-norm).",
    )
    group.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Count of zero entries of the reduced grads in the log line and TensorBoard.",
    )


def _add_fp16(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fp16 and loss scaling")
    group.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 params and compute with fp32 main params and loss scaling (dynamic "
        "unless --loss-scale).",
    )
    group.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="Static loss scale (a positive power of 2 works best); default dynamic.",
    )
    group.add_argument(
        "--initial-loss-scale", type=float, default=2**32, help="Dynamic scale's start."
    )
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Dynamic scale floor.")
    group.add_argument(
        "--loss-scale-window",
        type=float,
        default=1000,
        help="Overflow-free iterations before the dynamic scale doubles.",
    )
    group.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="Overflows tolerated before the dynamic scale halves.",
    )


def _add_profiling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Profile iterations --profile-step-start .. --profile-step-end - 1: an Nsight "
        "capture range (cudaProfilerStart/Stop) or, with --use-pytorch-profiler, a "
        "torch.profiler trace.",
    )
    group.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="With --profile: write a Chrome trace to <--tensorboard-dir>/../torch_profile/"
        "rank-R.json.gz (as Megatron-LM).",
    )
    group.add_argument(
        "--profile-step-start", type=int, default=10, help="First profiled iteration."
    )
    group.add_argument(
        "--profile-step-end", type=int, default=12, help="Iteration the profile stops at."
    )
    group.add_argument(
        "--profile-ranks",
        nargs="+",
        type=int,
        default=[],
        help="Global ranks to profile (default: all).",
    )
    group.add_argument(
        "--record-memory-history",
        action="store_true",
        help="Record CUDA allocator history and dump a snapshot at every log interval to "
        "--memory-snapshot-path (with _RANK before the extension). CUDA only.",
    )
    group.add_argument(
        "--memory-snapshot-path",
        default="snapshot.pickle",
        help="Where --record-memory-history writes its snapshot.",
    )


def _add_knobs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Megatron-LM implementation knobs (accepted; the log says why a given one does not apply)"
    )
    for flag, (options, _) in _KNOBS.items():
        group.add_argument(flag, **options)


_NCCL_UB = (
    "--use-nccl-ub / --fsdp-double-buffer / --fsdp-manual-registration: NCCL user-buffer "
    "registration is not built; it changes only NCCL speed, never results.{no_nccl}"
)
# flag -> (add_argument options, the log note when its value is not the default ({v}: the
# value), None: no note). Flags sharing a note log it once.
_KNOBS: dict[str, tuple[dict, str | None]] = {
    "--use-mcore-models": (
        dict(action="store_true", help="The only model here is mcore-style."),
        "--use-mcore-models: the mcore-style GPTModel is the only model here, so this is the "
        "default.",
    ),
    "--transformer-impl": (
        dict(
            choices=("transformer_engine", "local", "inference_optimized"),
            default=None,
            help="TransformerEngine or Megatron's local layers; here always our own PyTorch "
            "layers.",
        ),
        "--transformer-impl {v}: the layers here are our own PyTorch modules with our FP8 "
        "Linear, not TransformerEngine or Megatron's local ones; the model math is the same.",
    ),
    "--attention-backend": (
        dict(
            choices=("auto", "flash", "fused", "unfused", "local"),
            default="auto",
            help="Attention kernel family; here torch's scaled_dot_product_attention picks it.",
        ),
        "--attention-backend {v}: attention runs torch's scaled_dot_product_attention, which "
        "picks its kernel (flash / memory-efficient / math) itself.",
    ),
    "--no-gradient-accumulation-fusion": (
        dict(
            action="store_false",
            dest="gradient_accumulation_fusion",
            help="FP8 weights' wgrad GEMMs return bf16 grads instead of writing fp32 grads.",
        ),
        "--no-gradient-accumulation-fusion: FP8 weights' wgrad GEMMs return bf16 grads, cast "
        "into the grad buffer by a second pass; high-precision weights always work that way.",
    ),
    "--cross-entropy-loss-fusion": (
        dict(action="store_true", help="Fused cross-entropy; here compiled by --torch-compile."),
        "--cross-entropy-loss-fusion: torch's cross_entropy (fp32), fused by --torch-compile "
        "(the CUDA default) except under tensor parallelism; no other fused kernel here.",
    ),
    "--attention-softmax-in-fp32": (
        dict(action="store_true", help="Softmax in fp32 (scaled_dot_product_attention does)."),
        "--attention-softmax-in-fp32: scaled_dot_product_attention already accumulates its "
        "softmax in fp32.",
    ),
    "--apply-query-key-layer-scaling": (
        dict(
            action="store_true",
            help="Scale QK^T by 1/layer before an fp16 softmax; equal math, only fp16 range.",
        ),
        "--apply-query-key-layer-scaling: the 1/layer scaling cancels in exact math; the "
        "fp32-accumulating softmax here needs no guard against fp16 overflow.",
    ),
    "--deterministic-mode": (
        dict(action="store_true", help="torch.use_deterministic_algorithms(True) for the run."),
        None,
    ),
    "--no-create-attention-mask-in-dataloader": (
        dict(
            action="store_false",
            dest="create_attention_mask_in_dataloader",
            help="No attention mask from the data loader (none is ever made here: causal kernel).",
        ),
        "--no-create-attention-mask-in-dataloader: no mask is ever built here (causal "
        "attention kernel).",
    ),
    "--use-nccl-ub": (dict(action="store_true", help="NCCL user-buffer registration."), _NCCL_UB),
    "--fsdp-double-buffer": (
        dict(action="store_true", help="Megatron-FSDP NCCL double buffer."),
        _NCCL_UB,
    ),
    "--fsdp-manual-registration": (
        dict(action="store_true", help="Megatron-FSDP manual NCCL buffer registration."),
        _NCCL_UB,
    ),
    "--use-persistent-ckpt-worker": (
        dict(action="store_true", help="Keep the async checkpoint worker alive between saves."),
        "--use-persistent-ckpt-worker: --async-save writes from a thread of each rank; there "
        "is no separate worker process to keep.",
    ),
    "--no-ckpt-fully-parallel-save": (
        dict(
            action="store_false",
            dest="ckpt_fully_parallel_save",
            help="Let one rank of each replica group write (here each rank writes its own shard).",
        ),
        "--no-ckpt-fully-parallel-save: each rank writes its own shard here; there is no "
        "replica-group writer choice.",
    ),
    "--dist-ckpt-strictness": (
        dict(
            choices=_STRICTNESS,
            default="assume_ok_unexpected",
            help="What loading does with missing/unexpected keys; here loads are always strict.",
        ),
        "--dist-ckpt-strictness {v}: loads here are strict (a missing or unexpected key stops "
        "the load with an error).",
    ),
    "--dist-ckpt-optim-fully-reshardable": (
        dict(
            action="store_true",
            help="Reshardable optimizer checkpoints (torch_dist ones always are here).",
        ),
        "--dist-ckpt-optim-fully-reshardable: torch_dist optimizer state here always reshards "
        "to any data-parallel size.",
    ),
}


def knob_notes(args: argparse.Namespace, *, cuda: bool) -> list[str]:
    """Why each given implementation knob changes nothing here, in the table's order."""
    notes: list[str] = []
    no_nccl = "" if cuda else " (No NCCL on this CPU run anyway.)"
    for flag, (options, note) in _KNOBS.items():
        value = getattr(args, options.get("dest", flag[2:].replace("-", "_")))
        default = options.get("default", options.get("action") == "store_false")
        if note is not None and value != default:
            text = note.format(v=value, no_nccl=no_nccl)
            if text not in notes:
                notes.append(text)
    return notes


_SIZE_ONE = ("--pipeline-model-parallel-size", "--context-parallel-size")
_SWITCHES = ("--tp-comm-overlap", "--fim-data", "--verify-integrity")


def _add_unbuilt(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Megatron-LM features not built here (sizes of 1 and 'off' are accepted; anything "
        "else is refused at parse time)"
    )
    for flag in _SIZE_ONE:
        group.add_argument(flag, type=int, default=1, help="Must be 1 here (not built above).")
    for flag in (
        "--expert-tensor-parallel-size",
        "--virtual-pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
    ):
        group.add_argument(flag, type=int, default=None, help="Not built here (refused).")
    for flag in _SWITCHES:
        group.add_argument(flag, action="store_true", help="Not built here (refused).")
    for flag in ("--fim-rate", "--fim-spm-rate"):
        group.add_argument(flag, type=float, default=None, help="Not built here (refused).")
    group.add_argument("--step-batch-size-schedule", default=None, help="Not built here (refused).")
    group.add_argument(
        "--rampup-batch-size", nargs="+", default=None, help="Not built here (refused)."
    )
    group.add_argument(
        "--rerun-mode",
        choices=("disabled", "validate_results", "report_stats"),
        default="disabled",
        help="Megatron-LM's re-run engine; only 'disabled' here (NaN/Inf losses stop the run "
        "through --check-for-nan-in-loss-and-grad).",
    )


_NO_PIPELINE = "no pipeline (size 1)"
_PLAIN_DATA = "plain GPT data"
_CONSTANT_BATCH = "a constant --global-batch-size"
# What to use instead of each feature not built, in the order the refusal names them. A flag
# is refused when its value is not its default (_ACCEPTED), written as "flag value" (switches:
# the flag alone) unless _WRITTEN says otherwise.
_UNBUILT = {
    "--pipeline-model-parallel-size": (
        "data parallelism, Megatron-FSDP (--use-megatron-fsdp) for memory"
    ),
    "--virtual-pipeline-model-parallel-size": _NO_PIPELINE,
    "--num-layers-per-virtual-pipeline-stage": _NO_PIPELINE,
    "--context-parallel-size": "activation recompute (--recompute-granularity) for long sequences",
    "--expert-tensor-parallel-size": "a dense model",
    "--moe-token-dispatcher-type": "--moe-token-dispatcher-type alltoall or allgather",
    "--tp-comm-overlap": "tensor-parallel collectives without the overlap",
    "--fim-data": _PLAIN_DATA,
    "--fim-rate": _PLAIN_DATA,
    "--fim-spm-rate": _PLAIN_DATA,
    "--step-batch-size-schedule": _CONSTANT_BATCH,
    "--rampup-batch-size": _CONSTANT_BATCH,
    "--rerun-mode": "--rerun-mode disabled with --check-for-nan-in-loss-and-grad",
    "--verify-integrity": "torch_dist checkpoints without hashes",
}
_ACCEPTED = {
    **dict.fromkeys(_SIZE_ONE, (1,)),
    **dict.fromkeys(_SWITCHES, (False,)),
    "--expert-tensor-parallel-size": (None, 1),
    "--rerun-mode": ("disabled",),
    "--moe-token-dispatcher-type": ("alltoall", "allgather"),
}
_WRITTEN = {
    "--moe-token-dispatcher-type": "--moe-token-dispatcher-type {v} (DeepEP/HybridEP)",
    "--tp-comm-overlap": "--tp-comm-overlap (userbuffers)",
    "--step-batch-size-schedule": "--step-batch-size-schedule",
    "--rampup-batch-size": "--rampup-batch-size",
}


def unbuilt_features(args: argparse.Namespace) -> str | None:
    """One message naming every not-built feature the command line asks for, or None."""
    found = []
    for flag, instead in _UNBUILT.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in _ACCEPTED.get(flag, (None,)):
            written = _WRITTEN.get(flag, flag if flag in _SWITCHES else flag + " {v}")
            found.append(f"{written.format(v=value)} (use {instead})")
    found += unbuilt_moe_features(args)
    found += unbuilt_table_flags(args)
    if not found:
        return None
    lines = "; ".join(found)
    return (
        f"megatron-fp8 has not built these Megatron-LM features: {lines}. Supported: one model "
        "replica per tensor-parallel group (pipeline and context parallel sizes 1) with data "
        "parallelism, Megatron-FSDP, --use-distributed-optimizer or --use-torch-fsdp2; dense "
        "GPT models, and MoE GPT models with expert parallelism inside the data-parallel ranks."
    )
