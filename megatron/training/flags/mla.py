"""DeepSeek-V3-style flags (Megatron-LM core_v0.19.0's names and defaults): --qk-layernorm,
multi-latent attention with its rotary scaling, and multi-token prediction.

The model code is megatron/core/transformer/attention.py, mla.py, rope.py and mtp.py; the
rules for latent ranks and head dims live once in mla.mla_config_problem and for MTP in
mtp.mtp_config_problem, run here on the flags (one `error:` line, exit 2). Parse-time code.
"""

from __future__ import annotations

import argparse

from megatron.core.transformer.mla import mla_config_problem
from megatron.core.transformer.mtp import mtp_config_problem

# TransformerConfig fields that are the flags of the same name.
MLA_CONFIG_FIELDS = (
    "qk_layernorm",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
)
# TransformerConfig field -> flag attribute, where Megatron-LM's flag name differs.
YARN_CONFIG_FLAGS = {
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
}


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "DeepSeek-V3-style attention and multi-token prediction (as Megatron-LM)"
    )
    group.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Norm (--normalization) on each query and key head before rotary; with "
        "--multi-latent-attention on the q and kv latents.",
    )
    group.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="Multi-latent attention: low-rank joint key-value (and optional query) "
        "compression with a decoupled rotary part shared by all heads.",
    )
    group.add_argument(
        "--q-lora-rank", type=int, default=None, help="Query compression rank (None: none)."
    )
    group.add_argument("--kv-lora-rank", type=int, default=32, help="Key-value latent rank.")
    group.add_argument("--qk-head-dim", type=int, default=128, help="q/k channels w/o rotary.")
    group.add_argument(
        "--qk-pos-emb-head-dim", type=int, default=64, help="q/k rotary channels per head."
    )
    group.add_argument("--v-head-dim", type=int, default=128, help="Value channels per head.")
    group.add_argument(
        "--rope-type",
        choices=("rope", "yarn"),
        default=None,
        help="Rotary frequencies; default yarn with --multi-latent-attention, else rope.",
    )
    _add_yarn_args(group)
    group.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="Multi-token prediction depths; depth k predicts token t + 1 + k.",
    )
    group.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="Weight of the mean of the MTP losses added to the training loss.",
    )


def _add_yarn_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--rotary-scaling-factor", type=float, default=1.0, help="YaRN scale factor s."
    )
    group.add_argument(
        "--mscale", type=float, default=1.0, help="YaRN mscale of the cos/sin factor."
    )
    group.add_argument(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN mscale_all_dim (cos/sin divisor and MLA softmax scale).",
    )
    for flag, default, text in (
        ("--yarn-original-max-position-embeddings", 4096, "YaRN's pre-extension context."),
        ("--yarn-beta-fast", 32.0, "YaRN's high-rotation bound."),
        ("--yarn-beta-slow", 1.0, "YaRN's low-rotation bound."),
    ):
        kind = int if isinstance(default, int) else float
        group.add_argument(flag, type=kind, default=None, help=f"{text} (None: {default}).")


def mla_config_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """TransformerConfig keyword arguments of these flags (yarn ones only when given)."""
    kwargs: dict[str, object] = {name: getattr(args, name) for name in MLA_CONFIG_FIELDS}
    for field, attr in YARN_CONFIG_FLAGS.items():
        if getattr(args, attr) is not None:
            kwargs[field] = getattr(args, attr)
    return kwargs


def validate_mla_args(args: argparse.Namespace) -> None:
    """Raise ValueError (one line naming the flags and the fix) for settings that cannot work."""
    fp8 = args.fp8_recipe is not None
    for problem in (mla_config_problem(args, fp8=fp8), mtp_config_problem(args)):
        if problem is not None:
            raise ValueError(problem)
