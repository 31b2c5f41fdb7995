"""Megatron-LM's flags at parse time (defined in megatron_lm.py): mapped onto ours, with the log
notes for given knobs that do not apply here or cost measured quality (resolve_megatron_lm_args),
and checked (validate_megatron_lm_args). It maps configs.resolved_flags' copy of the flags
(never parse_args' Namespace); nothing runs below pretrain()."""

from __future__ import annotations

import argparse

import torch

from megatron.training.flags.megatron_lm import knob_notes
from megatron.training.flags.megatron_lm_table import table_notes
from megatron.training.flags.mla import validate_mla_args
from megatron.training.flags.mup import mup_notes, validate_mup_args
from megatron.training.flags.optimizer import optimizer_notes
from megatron.training.flags.recompute import validate_recompute_args


def resolve_megatron_lm_args(args: argparse.Namespace) -> list[str]:
    """Map the Megatron-LM flags onto ours; return the log notes for given flags that do not
    apply here. Raises ValueError (shown as one `error:` line) for a value we cannot honour."""
    _resolve_parallel(args)
    _resolve_fsdp_dtypes(args)
    return _notes(args) + table_notes(args) + mup_notes(args) + optimizer_notes(args)


def _resolve_parallel(args: argparse.Namespace) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off at tensor-parallel size 1
        args.sequence_parallel_given = True
    else:
        args.sequence_parallel_given = False


def _resolve_fsdp_dtypes(args: argparse.Namespace) -> None:
    """Megatron-LM's --megatron-fsdp-*-dtype names onto --main-params-dtype,
    --main-grads-dtype and --grad-reduce-in-bf16 ('auto': the params' dtype)."""
    params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    main_params = args.megatron_fsdp_main_params_dtype
    if main_params is not None:
        resolved = params_dtype if main_params == "auto" else main_params
        if resolved != "fp32":
            raise ValueError(
                f"--megatron-fsdp-main-params-dtype {main_params} means {resolved} main params; "
                "only fp32 main params are built: pass fp32 (or leave it out)."
            )
        args.main_params_dtype = "fp32"
    main_grads = args.megatron_fsdp_main_grads_dtype
    if main_grads is not None:
        resolved = params_dtype if main_grads == "auto" else main_grads
        if resolved not in ("fp32", "bf16", "fp64"):
            raise ValueError(
                f"--megatron-fsdp-main-grads-dtype {main_grads} means {resolved} grads; use fp32, "
                "bf16 or fp64."
            )
        args.main_grads_dtype = resolved
    comm = args.megatron_fsdp_grad_comm_dtype
    if comm is not None:
        resolved = args.main_grads_dtype if comm == "auto" else comm
        if resolved not in ("fp32", "bf16") and resolved != args.main_grads_dtype:
            raise ValueError(
                f"--megatron-fsdp-grad-comm-dtype {comm} means {resolved}; use fp32 or bf16 (or "
                "auto: the grad-buffer dtype)."
            )
        if resolved == "fp32" and args.main_grads_dtype == "fp64":
            raise ValueError(
                "--megatron-fsdp-grad-comm-dtype fp32 with fp64 grad buffers is not built; use "
                "auto (fp64) or bf16."
            )
        if resolved == "bf16":
            args.grad_reduce_in_bf16 = True
        elif args.main_grads_dtype == "bf16":
            raise ValueError(
                "--megatron-fsdp-grad-comm-dtype fp32 with bf16 grad buffers is not built; use "
                "--megatron-fsdp-main-grads-dtype fp32."
            )


def _notes(args: argparse.Namespace) -> list[str]:
    """Why each given knob changes nothing here (printed once, on rank 0)."""
    cuda = torch.cuda.is_available()
    return knob_notes(args, cuda=cuda) + [note for given, note in _run_notes(args, cuda) if given]


def _run_notes(args: argparse.Namespace, cuda: bool) -> tuple[tuple[bool, str], ...]:
    """(given, note) of the parallelism, data, timing and profiling flags."""
    return (
        (
            args.sequence_parallel_given,
            "--sequence-parallel: off at tensor-parallel size 1, as in Megatron-LM.",
        ),
        (
            args.num_workers != 2,
            f"--num-workers {args.num_workers}: batches are read in the "
            "training process (index lookups into memory-mapped files), no worker processes.",
        ),
        (
            not args.mmap_bin_files,
            "--no-mmap-bin-files: .bin files are memory-mapped here "
            "(same tokens; only the page-cache use differs).",
        ),
        (
            args.timing_log_level != 0,
            f"--timing-log-level {args.timing_log_level}: only level-0 timers exist here.",
        ),
        (
            args.empty_unused_memory_level > 0 and not cuda,
            f"--empty-unused-memory-level "
            f"{args.empty_unused_memory_level}: no CUDA caching allocator on this CPU run.",
        ),
        (
            args.profile and not args.use_pytorch_profiler and not cuda,
            "--profile without "
            "--use-pytorch-profiler marks an Nsight capture range (cudaProfilerStart/Stop); no "
            "CUDA on this run, so nothing is captured (add --use-pytorch-profiler for a trace).",
        ),
        (
            args.record_memory_history and not cuda,
            "--record-memory-history: the CUDA "
            "allocator history (torch.cuda.memory._record_memory_history) does not exist on "
            f"this CPU run; no snapshot is written to {args.memory_snapshot_path}.",
        ),
    )


def validate_megatron_lm_args(args: argparse.Namespace) -> None:
    """Value checks of the flags above (raise ValueError with the fix)."""
    if args.manual_gc_interval < 0:
        raise ValueError("--manual-gc-interval must be >= 0 (0: collect only around evaluation).")
    if args.distributed_timeout_minutes <= 0:
        raise ValueError("--distributed-timeout-minutes must be positive (default 10).")
    if args.num_workers < 0:
        raise ValueError("--num-workers must be >= 0.")
    validate_recompute_args(args)
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr (the peak it decays from).")
    if args.decoupled_lr is not None:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if not 0 <= floor <= args.decoupled_lr:
            raise ValueError(
                f"--decoupled-min-lr {floor} must be in [0, --decoupled-lr {args.decoupled_lr}]."
            )
    _validate_fp16(args)
    validate_mup_args(args)
    validate_mla_args(args)
    _validate_profiling(args)
    _validate_torch_fsdp2(args)


def _validate_torch_fsdp2(args: argparse.Namespace) -> None:
    if not args.use_torch_fsdp2:
        return
    conflicts = [
        flag
        for flag, given in (
            ("--use-megatron-fsdp", args.use_megatron_fsdp),
            ("--use-distributed-optimizer", args.use_distributed_optimizer),
            ("--fp16", args.fp16),
            ("--fp8-format/--fp8-recipe", args.fp8_format or args.fp8_recipe),
        )
        if given
    ]
    if conflicts:
        raise ValueError(
            f"--use-torch-fsdp2 does not go with {', '.join(conflicts)} here (Megatron-LM "
            "refuses it with the distributed optimizer, and with fp16: '--use-torch-fsdp2 not "
            "supported with fp16 yet'; FP8 weights under FSDP2 are not built): train FSDP2 "
            "with --bf16, or use --use-megatron-fsdp, the same sharding with FP8."
        )


def _validate_fp16(args: argparse.Namespace) -> None:
    if not args.fp16:
        return
    if args.bf16:
        raise ValueError("--fp16 and --bf16 exclude each other; pick one.")
    if args.fp8_recipe is not None or args.fp8_format is not None:
        raise ValueError("FP8 here trains with bf16 or fp32 params; use --bf16 instead of --fp16.")
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise ValueError(f"--loss-scale {args.loss_scale} must be > 0.")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ValueError("--min-loss-scale must be in (0, --initial-loss-scale].")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        raise ValueError("--loss-scale-window and --hysteresis must be >= 1.")


def _validate_profiling(args: argparse.Namespace) -> None:
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(
            f"--profile-step-start {args.profile_step_start} must be >= 0 and below "
            f"--profile-step-end {args.profile_step_end}."
        )
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ValueError(
            "--use-pytorch-profiler writes its trace to <--tensorboard-dir>/../torch_profile/ "
            "(as Megatron-LM); pass --tensorboard-dir DIR."
        )
