"""Tensor names of HuggingFace's DeepSeek-V3, Mixtral and Qwen3-MoE checkpoints against ours:
one table of rules per model, read forwards by the import and backwards by the export, so a
name or a piece order is written once.

The names are those of the checkpoint files (what `save_pretrained` writes and what the
published checkpoints hold): one tensor per expert, `...experts.{e}.gate_proj/up_proj/
down_proj.weight` (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2.weight`). Ours stack them:
`experts.linear_fc1.weight` [E, 2 x moe_ffn, hidden] holds expert e's [gate | up] rows and
`experts.linear_fc2.weight` [E, hidden, moe_ffn] its down projection.

DeepSeek-V3's multi-token prediction modules are not in transformers' modeling code (it drops
`model.layers.61.*` on load); DeepSeek's published checkpoint stores depth k as one more
decoder layer `model.layers.{num_hidden_layers + k - 1}.*`: its attention, MLP and norms map
onto our `mtp.layers.{k-1}.transformer_layer.*` like any layer's, and
    enorm, hnorm, eh_proj      -> mtp.layers.{k-1}.enorm, .hnorm, .eh_proj ([emb | hidden] in)
    shared_head.norm           -> mtp.layers.{k-1}.final_layernorm
    embed_tokens, shared_head.head: copies of the model's embedding and output head (ours
                                  shares them): checked equal on import, written on export.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.model_state import (
    ConversionError,
    SourceTensors,
    StateDict,
    expected_shapes,
)

MOE_ARCHITECTURES = ("deepseek_v3", "mixtral", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Our tensor `ours` is their tensors `theirs` concatenated along dim 0 (rows `sizes`),
    and, with `experts` > 0, that stacked over experts e (each name formatted with e)."""

    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    experts: int = 0


def _attention_rules(config: TransformerConfig, ours: str, theirs: str) -> list[Rule]:
    mine, hf = f"{ours}self_attention.", f"{theirs}self_attn."
    if config.multi_latent_attention:
        pairs = [
            ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
            ("kv_layernorm", "kv_a_layernorm"),
            ("linear_kv_up_proj", "kv_b_proj"),
            ("linear_proj", "o_proj"),
        ]
        if config.q_lora_rank is None:
            pairs.append(("linear_q_proj", "q_proj"))
        else:
            pairs += [
                ("linear_q_down_proj", "q_a_proj"),
                ("q_layernorm", "q_a_layernorm"),
                ("linear_q_up_proj", "q_b_proj"),
            ]
        return [Rule(f"{mine}{a}.weight", (f"{hf}{b}.weight",)) for a, b in pairs]
    q_rows = config.num_attention_heads * config.kv_channels
    kv_rows = config.num_query_groups * config.kv_channels
    rules = [
        Rule(
            f"{mine}linear_qkv.weight",
            tuple(f"{hf}{p}_proj.weight" for p in "qkv"),
            (q_rows, kv_rows, kv_rows),
        ),
        Rule(f"{mine}linear_proj.weight", (f"{hf}o_proj.weight",)),
    ]
    if config.qk_layernorm:
        rules += [Rule(f"{mine}{p}_layernorm.weight", (f"{hf}{p}_norm.weight",)) for p in "qk"]
    return rules


def _swiglu_rules(ours: str, theirs: str, width: int, experts: int = 0) -> list[Rule]:
    """fc1 = [gate | up], fc2 = down of a SwiGLU MLP (one expert's names hold `{e}`)."""
    gate_up = (f"{theirs}gate_proj.weight", f"{theirs}up_proj.weight")
    return [
        Rule(f"{ours}linear_fc1.weight", gate_up, (width, width), experts),
        Rule(f"{ours}linear_fc2.weight", (f"{theirs}down_proj.weight",), (), experts),
    ]


def _moe_rules(architecture: str, config: TransformerConfig, ours: str, theirs: str) -> list[Rule]:
    experts, width = config.num_moe_experts, config.moe_ffn_hidden_size
    mine = f"{ours}mlp."
    if architecture == "mixtral":
        hf = f"{theirs}block_sparse_moe."
        expert = f"{hf}experts.{{e}}."
        return [
            Rule(f"{mine}router.weight", (f"{hf}gate.weight",)),
            Rule(
                f"{mine}experts.linear_fc1.weight",
                (f"{expert}w1.weight", f"{expert}w3.weight"),
                (width, width),
                experts,
            ),
            Rule(f"{mine}experts.linear_fc2.weight", (f"{expert}w2.weight",), (), experts),
        ]
    hf = f"{theirs}mlp."
    rules = [Rule(f"{mine}router.weight", (f"{hf}gate.weight",))]
    if config.moe_router_enable_expert_bias:
        rules.append(Rule(f"{mine}router.expert_bias", (f"{hf}gate.e_score_correction_bias",)))
    rules += _swiglu_rules(f"{mine}experts.", f"{hf}experts.{{e}}.", width, experts)
    if config.moe_shared_expert_intermediate_size is not None:
        shared = config.moe_shared_expert_intermediate_size
        rules += _swiglu_rules(f"{mine}shared_experts.", f"{hf}shared_experts.", shared)
    return rules


def _layer_rules(
    architecture: str, config: TransformerConfig, ours: str, theirs: str, is_moe: bool
) -> list[Rule]:
    rules = [
        Rule(f"{ours}input_layernorm.weight", (f"{theirs}input_layernorm.weight",)),
        Rule(f"{ours}pre_mlp_layernorm.weight", (f"{theirs}post_attention_layernorm.weight",)),
        *_attention_rules(config, ours, theirs),
    ]
    if is_moe:
        return rules + _moe_rules(architecture, config, ours, theirs)
    return rules + _swiglu_rules(f"{ours}mlp.", f"{theirs}mlp.", config.ffn_hidden_size)


def _mtp_rules(architecture: str, config: TransformerConfig, names: set[str]) -> list[Rule]:
    """Depth k's own tensors at DeepSeek's `model.layers.{num_layers + k - 1}.*`."""
    rules = []
    for depth in range(config.mtp_num_layers or 0):
        ours, theirs = f"mtp.layers.{depth}.", f"model.layers.{config.num_layers + depth}."
        pairs = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"))
        pairs += (("final_layernorm", "shared_head.norm"),)
        rules += [Rule(f"{ours}{a}.weight", (f"{theirs}{b}.weight",)) for a, b in pairs]
        layer = f"{ours}transformer_layer."
        is_moe = f"{layer}mlp.router.weight" in names
        rules += _layer_rules(architecture, config, layer, theirs, is_moe)
    return rules


def layout_rules(architecture: str, config: TransformerConfig) -> list[Rule]:
    """Every rule of the model `config` builds, in the HF file's order of layers."""
    names = set(expected_shapes(config))
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_norm.weight", ("model.norm.weight",)),
    ]
    if config.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    for index in range(config.num_layers):
        ours, theirs = f"decoder.layers.{index}.", f"model.layers.{index}."
        is_moe = f"{ours}mlp.router.weight" in names
        rules += _layer_rules(architecture, config, ours, theirs, is_moe)
    return rules + _mtp_rules(architecture, config, names)


def _mtp_copies(config: TransformerConfig) -> dict[str, str]:
    """{HF name: our name} of the tensors DeepSeek's MTP layers repeat from the main model."""
    head = "output_layer.weight"
    if not config.untie_embeddings_and_output_weights:
        head = "embedding.word_embeddings.weight"
    copies = {}
    for depth in range(config.mtp_num_layers or 0):
        theirs = f"model.layers.{config.num_layers + depth}."
        copies[f"{theirs}embed_tokens.weight"] = "embedding.word_embeddings.weight"
        copies[f"{theirs}shared_head.head.weight"] = head
    return copies


def _take_rule(files: SourceTensors, rule: Rule) -> torch.Tensor:
    def joined(expert: int) -> torch.Tensor:
        pieces = [files.take(name.format(e=expert)) for name in rule.theirs]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    if rule.experts:
        return torch.stack([joined(expert) for expert in range(rule.experts)])
    return joined(0)


def _take_copy(files: SourceTensors, name: str, original: torch.Tensor) -> None:
    if name in files.tensors and not torch.equal(files.take(name), original):
        raise ConversionError(
            f"{files.source}: {name} differs from the tensor it repeats; our model shares one"
        )


def hf_to_ours(architecture: str, files: SourceTensors, config: TransformerConfig) -> StateDict:
    """Take every tensor of the rules from `files` (the tied head's and MTP's copies of the
    embedding and head are checked equal, and may be absent)."""
    ours = {rule.ours: _take_rule(files, rule) for rule in layout_rules(architecture, config)}
    copies = dict(_mtp_copies(config))
    if not config.untie_embeddings_and_output_weights:
        copies["lm_head.weight"] = "embedding.word_embeddings.weight"
    for theirs, mine in copies.items():
        _take_copy(files, theirs, ours[mine])
    return ours


def ours_to_hf(architecture: str, state_dict: StateDict, config: TransformerConfig) -> StateDict:
    """The rules backwards: split concatenations, unstack experts, write MTP's copies."""
    hf: StateDict = {}
    for rule in layout_rules(architecture, config):
        tensor = state_dict[rule.ours]
        for expert in range(rule.experts or 1):
            joined = tensor[expert] if rule.experts else tensor
            if rule.sizes and joined.shape[0] != sum(rule.sizes):
                raise ValueError(
                    f"{rule.ours} has {joined.shape[0]} rows; the config implies "
                    f"{' + '.join(map(str, rule.sizes))}: pass the config saved with the checkpoint"
                )
            pieces = torch.split(joined, list(rule.sizes)) if rule.sizes else (joined,)
            for name, piece in zip(rule.theirs, pieces, strict=True):
                hf[name.format(e=expert)] = piece
    for theirs, mine in _mtp_copies(config).items():
        hf[theirs] = state_dict[mine]
    return hf
