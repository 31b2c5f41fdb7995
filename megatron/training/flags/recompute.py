"""Activation-recompute flags with Megatron-LM core_v0.19.0's names, defaults and rules.

- `--recompute-activations` means `--recompute-granularity selective` (Megatron-LM sets it over
  any given granularity; the log says so when it replaces `full`); `--moe-layer-recompute`
  (Megatron-LM's deprecated spelling) means selective with `moe` added to the modules.
- `full` needs `--recompute-method` (uniform or block) and `--recompute-num-layers` (>= 1);
  `selective` takes neither; these are Megatron-LM's refusals, in one line each. Without a
  granularity both are ignored, as there (log note).
- `--recompute-modules` (selective only; default core_attn): the submodules run under
  activation checkpoint, keeping only their inputs. Built: the ones Megatron-LM recomputes that
  way: core_attn, mlp (dense layers), moe (the whole MoE layer) and shared_experts. The ones
  Megatron-LM recomputes by dropping their output after its consumer runs (layernorm, moe_act,
  mla_up_proj) and the ones of layers not built here are refused, naming the built ones; so
  is a recomputed MLP that would read an FP8 weight copy Megatron-FSDP released after forward
  (mxfp8's rowwise copy under ZeRO-3).

Parse-time code: validate_recompute_args reads the flags as given; recompute_config_kwargs
builds the TransformerConfig fields from them.
"""

from __future__ import annotations

import argparse

from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.recompute import RECOMPUTE_MODULES as BUILT_MODULES
from megatron.core.transformer.transformer_config import TransformerConfig

DEFAULT_MODULES: tuple[str, ...] = TransformerConfig.recompute_modules  # core_attn
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
IGNORED_NOTE = (
    "{} without --recompute-granularity: ignored (no activation recompute), as in Megatron-LM."
)
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
        "--moe-layer-recompute",
        action="store_true",
        help="Megatron-LM's deprecated spelling of selective recompute with the moe module.",
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
        nargs="+",
        default=None,
        help=f"With selective: submodules to recompute, of {', '.join(BUILT_MODULES)} "
        f"(default {' '.join(DEFAULT_MODULES)}).",
    )


def granularity(args: argparse.Namespace) -> str | None:
    """The recompute granularity these flags mean (--recompute-activations and
    --moe-layer-recompute: selective)."""
    if args.recompute_activations or args.moe_layer_recompute:
        return "selective"
    return args.recompute_granularity


def modules(args: argparse.Namespace) -> tuple[str, ...]:
    given = DEFAULT_MODULES if args.recompute_modules is None else tuple(args.recompute_modules)
    moe = ("moe",) if args.moe_layer_recompute and "moe" not in given else ()
    return given + moe


def validate_recompute_args(args: argparse.Namespace) -> None:
    """Megatron-LM's recompute rules and the unbuilt modules (raise ValueError with the fix)."""
    # (--recompute-activations first makes the line selective, as in Megatron-LM.)
    moe_full = args.moe_layer_recompute and args.recompute_granularity == "full"
    if moe_full and not args.recompute_activations:
        raise ValueError(
            "--moe-layer-recompute goes with selective recompute, not --recompute-granularity "
            "full (as in Megatron-LM); drop one."
        )
    given = granularity(args)
    if given == "full":
        if args.recompute_method is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method uniform or block (as in "
                "Megatron-LM); add one."
            )
        if args.recompute_num_layers is None or args.recompute_num_layers < 1:
            raise ValueError(
                "--recompute-granularity full needs --recompute-num-layers of at least 1 (as in "
                f"Megatron-LM; given {args.recompute_num_layers})."
            )
    elif given == "selective":
        for flag, value in _full_only(args):
            if value is not None:
                raise ValueError(
                    f"{flag} {value} goes with --recompute-granularity full, not selective (as "
                    "in Megatron-LM); drop it or recompute full layers."
                )
        _validate_modules(args)


def _full_only(args: argparse.Namespace) -> tuple[tuple[str, int | str | None], ...]:
    """The flags that only full recompute reads, with their values."""
    return (
        ("--recompute-method", args.recompute_method),
        ("--recompute-num-layers", args.recompute_num_layers),
    )


def _validate_modules(args: argparse.Namespace) -> None:
    recomputed = modules(args)
    for name in recomputed:
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
    released = [name for name in ("mlp", "moe", "shared_experts") if name in recomputed]
    if released and _forward_copy_released(args):
        raise ValueError(
            f"--recompute-modules {' '.join(released)} with --fp8-recipe {args.fp8_recipe} "
            "FP8 parameters under --data-parallel-sharding-strategy optim_grads_params is not "
            "built: the recompute would read the forward weight copy the engine released "
            "after forward; recompute core_attn only, use --recompute-granularity full, or "
            "the optim_grads strategy."
        )


def _forward_copy_released(args: argparse.Namespace) -> bool:
    """Megatron-FSDP ZeRO-3 keeps a separately quantized columnwise copy of each FP8 weight
    parameter for backward and releases the rowwise (forward) one after forward."""
    if not (args.fp8_param_gather and args.fp8_recipe and args.use_megatron_fsdp):
        return False
    zero3 = args.data_parallel_sharding_strategy == "optim_grads_params"
    return zero3 and recipe_spec(args.fp8_recipe).columnwise_copy("weight")


def recompute_notes(flags: argparse.Namespace) -> list[str]:
    """The log notes (resolved flags: the compile and FP8 defaults are filled in). Measured
    with tests/unit_tests/training/test_torch_compile.py: a module whose forward records
    breaks the compiled graph at its checkpoint and runs eager; the others compile."""
    notes = []
    if flags.recompute_activations and flags.recompute_granularity == "full":
        notes.append(REPLACED_NOTE)
    if granularity(flags) is None:
        for flag, value in _full_only(flags):
            if value is not None:
                notes.append(IGNORED_NOTE.format(flag))
    if granularity(flags) != "selective" or not flags.torch_compile:
        return notes
    recomputed = modules(flags)
    if flags.num_experts is not None and "moe" in recomputed:
        notes.append(EAGER_NOTE.format("moe", EAGER_REASONS["moe"]))
    dense = ["mlp"] if "mlp" in recomputed else []
    if flags.moe_shared_expert_intermediate_size and "shared_experts" in recomputed:
        dense.append("shared_experts")
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
        recompute_modules=modules(args) if given == "selective" else DEFAULT_MODULES,
    )
