"""muP flags (Megatron-LM core_v0.19.0's names and defaults) and their parse-time checks.

The formulas live in megatron/core/transformer/mup.py (model) and
megatron/core/optimizer/optimizer.py (per-group lr/eps); here the flags are defined, checked
(one `error:` line, exit 2) and turned into config fields. Parse-time code on the Namespace.
"""

from __future__ import annotations

import argparse

# TransformerConfig fields that are the flags of the same name.
MUP_CONFIG_FIELDS = (
    "use_mup",
    "mup_base_hidden_size",
    "mup_base_head_dim",
    "mup_attn_scale_power",
    "mup_embedding_mult",
    "mup_output_mult",
)


def add_mup_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("muP (maximal update parametrization, as Megatron-LM)")
    group.add_argument(
        "--use-mup",
        action="store_true",
        help="muP with width mult m = hidden / --mup-base-hidden-size: hidden init std / "
        "sqrt(m) (output projections also / sqrt(2 L)), embeddings and the untied output layer "
        "at the base std, softmax scale sqrt(base head dim) / kv_channels^power, logits times "
        "--mup-output-mult, Adam lr and eps of hidden matrices / m.",
    )
    group.add_argument(
        "--mup-base-hidden-size",
        type=int,
        default=None,
        help="Hidden size of the base model the hyperparameters were tuned on (None: "
        "--hidden-size, so m = 1).",
    )
    group.add_argument(
        "--mup-base-head-dim",
        type=int,
        default=None,
        help="Head dim of the base model; the softmax scale is sqrt(it) / kv_channels^power "
        "(None: 1 / kv_channels^power).",
    )
    group.add_argument(
        "--mup-attn-scale-power",
        type=float,
        default=1.0,
        help="Power of kv_channels in the muP softmax scale (1: 1/d attention, 0.5: 1/sqrt(d)).",
    )
    group.add_argument(
        "--mup-embedding-mult",
        type=float,
        default=1.0,
        help="Multiplier of the embedding output under muP.",
    )
    group.add_argument(
        "--mup-output-mult",
        type=float,
        default=1.0,
        help="Multiplier of the logits under muP; 1.0 means 1 / m (Megatron-LM's auto value).",
    )


def mup_notes(args: argparse.Namespace) -> list[str]:
    """Without --use-mup the other muP flags do nothing (Megatron-LM ignores them too)."""
    given = [
        flag
        for flag, value, default in (
            ("--mup-base-hidden-size", args.mup_base_hidden_size, None),
            ("--mup-base-head-dim", args.mup_base_head_dim, None),
            ("--mup-attn-scale-power", args.mup_attn_scale_power, 1.0),
            ("--mup-embedding-mult", args.mup_embedding_mult, 1.0),
            ("--mup-output-mult", args.mup_output_mult, 1.0),
        )
        if value != default
    ]
    if given and not args.use_mup:
        return [f"{', '.join(given)}: no effect without --use-mup (as in Megatron-LM)."]
    return []


def validate_mup_args(args: argparse.Namespace) -> None:
    """Raise ValueError (one line) for muP values that cannot work."""
    for flag, value in (
        ("--mup-base-hidden-size", args.mup_base_hidden_size),
        ("--mup-base-head-dim", args.mup_base_head_dim),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value} must be positive.")
    for flag, value in (
        ("--mup-embedding-mult", args.mup_embedding_mult),
        ("--mup-output-mult", args.mup_output_mult),
    ):
        if not value > 0:
            raise ValueError(f"{flag} {value} must be positive.")


def mup_width_mult(args: argparse.Namespace) -> float:
    """hidden / base hidden under --use-mup (base default: hidden), else 1."""
    if not args.use_mup or args.mup_base_hidden_size is None:
        return 1.0
    return args.hidden_size / args.mup_base_hidden_size
