"""Model flags with Megatron-LM's names: the converter's command line, and the bridge between a
TransformerConfig and the flags (or Megatron-LM's saved args) that describe it.

Megatron-LM's args and our flags share these names (`--num-layers` is `args.num_layers` in both),
so one table serves the converter's command line, Megatron-LM's saved args (common.pt) and the
flags our saver records for `pretrain_gpt.py --use-checkpoint-args`.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flags.mla import MLA_CONFIG_FIELDS, YARN_CONFIG_FLAGS
from megatron.training.flags.moe import MOE_CONFIG_FIELDS
from tools.checkpoint.model_state import ConversionError

# TransformerConfig field -> flag dest of the MoE, latent-attention, rotary-scaling and MTP
# settings that shape the model (the training-only ones, losses and dispatch, are left out).
ARCHITECTURE_FLAGS = {
    **{
        field: dest
        for field, dest in MOE_CONFIG_FIELDS.items()
        if field.startswith(("num_moe", "moe_ffn", "moe_layer", "moe_shared", "moe_router_"))
        and field not in ("moe_router_load_balancing_type", "moe_router_bias_update_rate")
    },
    **{field: field for field in MLA_CONFIG_FIELDS if field != "mtp_loss_scaling_factor"},
    **YARN_CONFIG_FLAGS,
}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}

# flag dest -> (type, help). Booleans are store_true flags, as in pretrain_gpt.py.
MODEL_FLAGS: dict[str, tuple[type, str]] = {
    "num_layers": (int, "Transformer layers."),
    "hidden_size": (int, "Residual stream width."),
    "ffn_hidden_size": (int, "MLP inner width."),
    "num_attention_heads": (int, "Query heads."),
    "group_query_attention": (bool, "Grouped-query attention (with --num-query-groups)."),
    "num_query_groups": (int, "Key/value heads under GQA."),
    "kv_channels": (int, "Head width."),
    "max_position_embeddings": (int, "Rows of the learned position table / longest sequence."),
    "position_embedding_type": (str, "learned_absolute or rope."),
    "rotary_base": (int, "RoPE frequency base."),
    "rotary_percent": (float, "Fraction of head dims that rotate."),
    "normalization": (str, "LayerNorm or RMSNorm."),
    "norm_epsilon": (float, "Epsilon of every norm."),
    "swiglu": (bool, "SwiGLU MLP instead of GeLU."),
    "disable_bias_linear": (bool, "No biases in transformer Linears."),
    "untie_embeddings_and_output_weights": (bool, "Separate output-head weight."),
    "padded_vocab_size": (int, "Rows of the embedding table (default: read off the tensor)."),
}


CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags, for a source that does not record them; an absent flag stays absent."""
    group = parser.add_argument_group(
        "model (only where the source does not record it: Megatron-LM checkpoints without args)"
    )
    for dest, (kind, text) in MODEL_FLAGS.items():
        flag = "--" + dest.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(
                flag, type=kind, choices=CHOICES.get(dest), default=argparse.SUPPRESS, help=text
            )


def flag_values(config: TransformerConfig) -> dict:
    """{flag dest: value} that describe `config`'s architecture."""
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "group_query_attention": config.num_query_groups != config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "kv_channels": config.kv_channels,
        "max_position_embeddings": config.max_sequence_length,
        "position_embedding_type": config.position_embedding_type,
        "rotary_base": config.rotary_base,
        "rotary_percent": config.rotary_percent,
        "normalization": config.normalization,
        "norm_epsilon": config.layernorm_epsilon,
        "swiglu": config.swiglu,
        "disable_bias_linear": not config.add_bias_linear,
        "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
        "padded_vocab_size": config.vocab_size,
    }


def check_given_flags(config: TransformerConfig, given: dict, *, source: str) -> None:
    """A model flag on the command line must agree with what the source records."""
    recorded = flag_values(config)
    for dest, value in sorted(given.items()):
        if recorded[dest] != value:
            raise ConversionError(
                f"--{dest.replace('_', '-')} {value} contradicts {source}, which records "
                f"{recorded[dest]}; drop the flag (the source's value is used)"
            )


def config_to_argv(config: TransformerConfig) -> list[str]:
    """pretrain_gpt.py flags that build `config`, as a user would type them: --kv-channels,
    --ffn-hidden-size and GQA only where they differ from what the other flags imply."""
    values = flag_values(config)
    argv = []
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "max_position_embeddings",
        "position_embedding_type",
        "rotary_base",
        "rotary_percent",
        "normalization",
        "norm_epsilon",
    ):
        argv += ["--" + dest.replace("_", "-"), str(values[dest])]
    if config.ffn_hidden_size != 4 * config.hidden_size:
        argv += ["--ffn-hidden-size", str(config.ffn_hidden_size)]
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        argv += ["--kv-channels", str(config.kv_channels)]
    if values["group_query_attention"]:
        argv += ["--group-query-attention", "--num-query-groups", str(config.num_query_groups)]
    for dest in ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights"):
        if values[dest]:
            argv.append("--" + dest.replace("_", "-"))
    argv += architecture_argv(config)
    argv += ["--hidden-dropout", str(config.hidden_dropout)]
    argv += ["--attention-dropout", str(config.attention_dropout)]
    argv += ["--init-method-std", str(config.init_method_std)]
    return argv


def config_from_megatron_args(args: dict, *, source: str, **fixed) -> TransformerConfig:
    """TransformerConfig from Megatron-LM's arg names (its saved args, or our command line);
    `fixed` holds what the tensors themselves say (vocab rows, layers) when args do not."""
    values = {**fixed, **{k: v for k, v in args.items() if v is not None}}

    def need(dest: str):
        if values.get(dest) is None:
            raise ConversionError(
                f"{source}: records no {dest}; pass --{dest.replace('_', '-')} on the command line"
            )
        return values[dest]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    add_bias = values.get("add_bias_linear", not values.get("disable_bias_linear", False))
    # Megatron-LM's reading: --num-query-groups (default 1) counts only with GQA.
    groups = (values.get("num_query_groups") or 1) if values.get("group_query_attention") else heads
    return TransformerConfig(
        num_layers=need("num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=need("padded_vocab_size"),
        max_sequence_length=values.get("max_position_embeddings") or need("seq_length"),
        ffn_hidden_size=values.get("ffn_hidden_size") or 4 * hidden,
        num_query_groups=groups,
        kv_channels=values.get("kv_channels") or hidden // heads,
        position_embedding_type=values.get("position_embedding_type", "learned_absolute"),
        rotary_base=int(values.get("rotary_base", 10000)),
        rotary_percent=float(values.get("rotary_percent", 1.0)),
        normalization=values.get("normalization", "LayerNorm"),
        layernorm_epsilon=float(values.get("norm_epsilon", 1e-5)),
        swiglu=bool(values.get("swiglu", False)),
        add_bias_linear=bool(add_bias),
        hidden_dropout=float(values.get("hidden_dropout", 0.1)),
        attention_dropout=float(values.get("attention_dropout", 0.1)),
        untie_embeddings_and_output_weights=bool(
            values.get("untie_embeddings_and_output_weights", False)
        ),
        init_method_std=float(values.get("init_method_std", 0.02)),
    )


def architecture_argv(config: TransformerConfig) -> list[str]:
    """The ARCHITECTURE_FLAGS whose value differs from TransformerConfig's default, as
    pretrain_gpt.py flags (a list such as --moe-layer-freq as its Python expression)."""
    argv = []
    for field, dest in ARCHITECTURE_FLAGS.items():
        value = getattr(config, field)
        if value == _DEFAULTS[field] or value is None:
            continue
        if field == "moe_ffn_hidden_size" and value == config.ffn_hidden_size:
            continue  # the default, resolved in __post_init__
        if field == "rope_type" and value == ("yarn" if config.multi_latent_attention else "rope"):
            continue  # the default, resolved in __post_init__
        flag = "--" + dest.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv
