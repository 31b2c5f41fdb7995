"""--torch-compile: its definition and the resolution of its default (on with CUDA, off
without), which configs.resolved_flags runs at parse time."""

from __future__ import annotations

import argparse

import torch


def add_compile_args(group) -> None:
    group.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each transformer layer's forward (regional compile: identical "
        "layers share one compiled graph; the FSDP hooks and the FP8 kernels stay outside it, "
        "so the model's elementwise code fuses around them). The first iteration pays the "
        "compile (seconds on a GPU, tens of seconds on a CPU). Default None: compiled on CUDA "
        "(the fast configuration, docs/PERFORMANCE.md), eager on CPU.",
    )


def resolve_compile_default(args: argparse.Namespace) -> None:
    """resolve_torch_compile, its reason added to the startup notes."""
    reason = resolve_torch_compile(args)
    args.megatron_lm_notes.append(f"transformer layers run {reason}.")


def resolve_torch_compile(args: argparse.Namespace, *, cuda_available: bool | None = None) -> str:
    """Fill args.torch_compile (None: not given) and return the reason, for the startup log.

    On CUDA the transformer layers compile by default (the fast configuration); on CPU the
    default stays eager (the compile time dominates a CPU run). Every configuration these
    flags accept compiles (tests/unit_tests/training/test_torch_compile.py: fp32, FSDP2 bf16,
    FP8 recipes under Megatron-FSDP and DDP, activation recompute, MoE at EP 1 and 2;
    tests/unit_tests/tensor_parallel/test_tp_compile.py: TP with and without sequence
    parallelism, FP8 included), so none is refused."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if args.torch_compile is not None:
        given = "--torch-compile" if args.torch_compile else "--no-torch-compile"
        return f"{'compiled' if args.torch_compile else 'eager'} ({given})"
    args.torch_compile = cuda_available
    if not cuda_available:
        return "eager (the default without CUDA: compile time dominates a CPU run)"
    return "compiled (the default on CUDA; --no-torch-compile for eager)"
