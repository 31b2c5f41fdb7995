"""Activation-recompute flags with Megatron-LM core_v0.19.0's names, defaults and rules.

- `--recompute-activations` means `--recompute-granularity selective` (Megatron-LM sets it over
  any given granularity; the log says so when it replaces `full`).
- `full` needs `--recompute-method` (uniform or block) and `--recompute-num-layers` (1 to
  --num-layers); `selective` takes neither; these are Megatron-LM's refusals, in one line each.
- `--recompute-modules` (selective only; default core_attn): the submodules run under
  activation checkpoint, keeping only their inputs. Built: the ones Megatron-LM recomputes that
  way: core_attn, mlp (dense layers), moe (the whole MoE layer) and shared_experts. The ones
  Megatron-LM recomputes by dropping their output after its consumer runs (layernorm, moe_act,
  mla_up_proj) and the ones of layers not built here are refused, naming the built ones.

Parse-time code: validate_recompute_args reads the flags as given; recompute_config_kwargs
builds the TransformerConfig fields from them.
"""

from __future__ import annotations

import argparse

from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.recompute import RECOMPUTE_MODULES as BUILT_MODULES

# Megatron-LM's other choices (transformer_config.py): recomputed here by none of our layers.
UNBUILT_MODULES = {
    "layernorm": "drops the norm output after the next Linear runs",
    "moe_act": "drops the expert activation output after fc2 runs",
    "mla_up_proj": "drops the MLA up-projection output after attention runs",
    "gdn_norm_out": "a gated-delta-net layer, not built here",
    "gdp_in_proj": "a gated-delta-product layer, not built here",
    "gdp_qkv": "a gated-delta-product layer, not built here",
    "mhc": "hyper-connection layers, not built here",
}
REPLACED_NOTE = (
    "--recompute-activations sets --recompute-granularity selective over the given full, as "
    "Megatron-LM does."
)

EAGER_NOTE = (
    "--recompute-modules {} with --torch-compile: each such module runs eager inside its "
    "activation checkpoint ({}); the rest of each layer compiles."
)
# Why a recomputed module cannot be traced into a compiled checkpoint: its forward's records
# (side effects its recompute skips by design) or its host token counts.
EAGER_REASONS = {
    "moe": "the router's records and the host token counts",
    "delayed": "delayed scaling's amax records",
}


def add_recompute_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("activation recompute (as Megatron-LM)")
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Selective recompute (--recompute-granularity selective) of --recompute-modules.",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: whole layers (with --recompute-method and --recompute-num-layers); "
        "selective: the --recompute-modules of every layer.",
    )
    group.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="With full: uniform checkpoints every chunk of --recompute-num-layers layers; "
        "block checkpoints only the first --recompute-num-layers layers.",
    )
    group.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="With full: layers per checkpointed chunk (uniform) or layers recomputed (block).",
    )
    group.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        help=f"With selective: submodules to recompute, of {', '.join(BUILT_MODULES)} "
        "(default core_attn).",
    )


def granularity(args: argparse.Namespace) -> str | None:
    """The recompute granularity these flags mean (--recompute-activations: selective)."""
    return "selective" if args.recompute_activations else args.recompute_granularity


def modules(args: argparse.Namespace) -> tuple[str, ...]:
    return ("core_attn",) if args.recompute_modules is None else tuple(args.recompute_modules)


def validate_recompute_args(args: argparse.Namespace) -> None:
    """Megatron-LM's recompute rules and the unbuilt modules (raise ValueError with the fix)."""
    given = granularity(args)
    if given == "full":
        if args.recompute_method is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method uniform or block (as in "
                "Megatron-LM); add one."
            )
        if args.recompute_num_layers is None or not (
            1 <= args.recompute_num_layers <= args.num_layers
        ):
            raise ValueError(
                f"--recompute-granularity full needs --recompute-num-layers between 1 and "
                f"--num-layers {args.num_layers} (given {args.recompute_num_layers})."
            )
        return
    for flag, value in (
        ("--recompute-method", args.recompute_method),
        ("--recompute-num-layers", args.recompute_num_layers),
    ):
        if value is not None:
            raise ValueError(
                f"{flag} {value} goes with --recompute-granularity full, not "
                f"{given or 'without recompute'}; drop it or recompute full layers."
            )
    if given == "selective":
        _validate_modules(args)


def _validate_modules(args: argparse.Namespace) -> None:
    for name in modules(args):
        if name in UNBUILT_MODULES:
            raise ValueError(
                f"--recompute-modules {name} (Megatron-LM's recompute that "
                f"{UNBUILT_MODULES[name]}) is not built; pick from {' '.join(BUILT_MODULES)}."
            )
        if name not in BUILT_MODULES:
            raise ValueError(
                f"--recompute-modules {name} is not a recompute module; pick from "
                f"{' '.join(BUILT_MODULES)}."
            )


def recompute_notes(flags: argparse.Namespace) -> list[str]:
    """The log notes (resolved flags: the compile and FP8 defaults are filled in). Measured
    with tests/unit_tests/training/test_torch_compile.py: a module whose forward records
    breaks the compiled graph at its checkpoint and runs eager; the others compile."""
    notes = []
    if flags.recompute_activations and flags.recompute_granularity == "full":
        notes.append(REPLACED_NOTE)
    if granularity(flags) != "selective" or not flags.torch_compile:
        return notes
    recomputed = modules(flags)
    if flags.num_experts is not None and "moe" in recomputed:
        notes.append(EAGER_NOTE.format("moe", EAGER_REASONS["moe"]))
    dense = [name for name in ("mlp", "shared_experts") if name in recomputed]
    if dense and flags.fp8_recipe is not None and recipe_spec(flags.fp8_recipe).delayed:
        notes.append(EAGER_NOTE.format(" ".join(dense), EAGER_REASONS["delayed"]))
    return notes


def recompute_config_kwargs(args: argparse.Namespace) -> dict:
    """TransformerConfig's recompute fields from the flags (validated)."""
    given = granularity(args)
    return dict(
        recompute_granularity=given,
        recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers or 1,
        recompute_modules=modules(args) if given == "selective" else ("core_attn",),
    )
