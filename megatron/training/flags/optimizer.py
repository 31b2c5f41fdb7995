"""Optimizer-state flags with Megatron-LM's spelling and meaning (the precision-aware optimizer
and its CPU offload) and their checks.

`add_optimizer_state_args` is registered in arguments.build_parser; `validate_optimizer_args`
runs from checks.validate_args and raises ValueError naming the flags and the fix (exit 2).
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer import check_optimizer_config
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.precision import STATE_DTYPES, is_scaled

MOMENT_DTYPES = tuple(STATE_DTYPES)
"""fp32, bf16, fp16, fp8: Megatron-LM's choices of --exp-avg-dtype / --exp-avg-sq-dtype."""


def add_optimizer_state_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimizer state (precision-aware optimizer, CPU offload)")
    group.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Keep the AdamW moments in --exp-avg-dtype / --exp-avg-sq-dtype (Megatron-LM's "
        "flag); fp16 and fp8 moments carry one fp32 scale per tensor, as TransformerEngine's.",
    )
    for flag, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        group.add_argument(
            flag,
            choices=MOMENT_DTYPES,
            default="fp32",
            help=f"dtype of AdamW's {moment} moment; other than fp32 needs "
            "--use-precision-aware-optimizer.",
        )
    group.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="Keep --optimizer-offload-fraction of the optimizer state, and its update, on the "
        "CPU (needs --use-precision-aware-optimizer, as in Megatron-LM).",
    )
    group.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="Fraction of the optimizer's elements offloaded with --optimizer-cpu-offload.",
    )


def optimizer_notes(args: argparse.Namespace) -> list[str]:
    """What the log says about a moment dtype that trains measurably worse (issue 37)."""
    if not (args.use_precision_aware_optimizer and args.exp_avg_sq_dtype == "fp8"):
        return []
    return [
        "--exp-avg-sq-dtype fp8: with one scale per tensor, a 128M GPT ended 1,000 steps 9-78% "
        "above fp32 moments' validation loss on an H100 and an H200; fp8 first with bf16 second "
        "moments stayed within 1% (docs/benchmarks/model_a_moments_8b_h200_2026-12-06.md). Use "
        "--exp-avg-sq-dtype bf16."
    ]


def validate_optimizer_args(args: argparse.Namespace) -> None:
    """Refuse optimizer-state settings the optimizer or the engine cannot hold (ValueError)."""
    config = OptimizerConfig(
        optimizer=args.optimizer,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
    )
    check_optimizer_config(config)
    if args.optimizer_cpu_offload and getattr(args, "use_torch_fsdp2", False):
        raise ValueError(
            "--optimizer-cpu-offload works with Megatron-FSDP and torch DDP; drop "
            "--use-torch-fsdp2 (use --use-megatron-fsdp) or drop --optimizer-cpu-offload"
        )
    scaled = [
        f"--{flag.replace('_', '-')} {getattr(args, flag)}"
        for flag in ("exp_avg_dtype", "exp_avg_sq_dtype")
        if is_scaled(STATE_DTYPES[getattr(args, flag)])
    ]
    if scaled and getattr(args, "use_torch_fsdp2", False):
        raise ValueError(
            f"{' and '.join(scaled)}: scaled moments are held by Megatron-FSDP and DDP, not by "
            "--use-torch-fsdp2's sharded moments; use --use-megatron-fsdp, or bf16/fp32 moments"
        )
    _validate_main_params_dtype(args)


def _validate_main_params_dtype(args: argparse.Namespace) -> None:
    if args.main_params_dtype == "fp32":
        return
    flag = f"--main-params-dtype {args.main_params_dtype}"
    if not args.use_precision_aware_optimizer:
        raise ValueError(f"{flag} needs --use-precision-aware-optimizer (as in Megatron-LM)")
    if not args.use_megatron_fsdp:
        raise ValueError(
            f"{flag}: only Megatron-FSDP holds non-fp32 main params; add --use-megatron-fsdp "
            "or use --main-params-dtype fp32"
        )
    if args.fp8_param_gather:
        raise ValueError(
            f"{flag}: FP8 parameters are re-quantized from fp32 main params; use "
            "--main-params-dtype fp32 or drop --fp8-param-gather"
        )
