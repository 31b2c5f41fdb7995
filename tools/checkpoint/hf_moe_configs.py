"""config.json of HuggingFace's DeepSeek-V3, Mixtral and Qwen3-MoE <-> our TransformerConfig.

What each maps to (every other key is checked to be a value our GPTModel computes, else the
import is refused naming it):
  - deepseek_v3: multi-latent attention with --qk-layernorm (its q_a/kv_a latent norms),
    dense MLP in the first `first_k_dense_replace` layers (--moe-layer-freq), sigmoid
    group-limited top-k routing with expert bias (`e_score_correction_bias`), top-k scaling
    (`routed_scaling_factor`), shared experts, YaRN or plain RoPE, and
    `num_nextn_predict_layers` MTP depths when the files hold them (hf_moe_layout.py).
    transformers' latent norms use eps 1e-6 whatever `rms_norm_eps` says, and its group score
    is the sum of each group's best 2 experts (ours: best topk / topk_group): configs where
    these differ from ours are refused.
  - mixtral: softmax over the k chosen logits (it normalizes the top-k probabilities), every
    layer MoE, no shared experts; `router_jitter_noise` acts in training only.
  - qwen3_moe: per-head q/k norms (--qk-layernorm), softmax over all experts then top-k
    (normalized again with `norm_topk_prob`: the k-logit softmax), dense layers from
    `mlp_only_layers` and `decoder_sparse_step`.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.moe.config_checks import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.hf_config_keys import refuse, required, rope_parameters, rope_theta

# transformers' DeepseekV3RMSNorm default, which its q_a and kv_a latent norms keep.
DEEPSEEK_LATENT_NORM_EPS = 1e-6
# transformers' DeepSeek-V3 group score: the sum of each group's best 2 expert scores.
DEEPSEEK_GROUP_SCORE_EXPERTS = 2
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _common(hf: dict, source: str, dtype: torch.dtype, *, experts_key: str) -> dict:
    """TransformerConfig fields every one of the three shares (the routed experts under
    `experts_key`, or transformers 5's `num_local_experts`)."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse(source, f"hidden_act {hf['hidden_act']!r}", "SwiGLU uses silu")
    if hf.get("attention_bias", False):
        refuse(source, "attention_bias", "MoE models here have no Linear biases")
    heads = required(hf, "num_attention_heads", source)
    return dict(
        num_layers=required(hf, "num_hidden_layers", source),
        hidden_size=required(hf, "hidden_size", source),
        num_attention_heads=heads,
        vocab_size=required(hf, "vocab_size", source),
        max_sequence_length=required(hf, "max_position_embeddings", source),
        ffn_hidden_size=required(hf, "intermediate_size", source),
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02),
        params_dtype=dtype,
        num_moe_experts=hf.get(experts_key) or required(hf, "num_local_experts", source),
        moe_router_topk=required(hf, "num_experts_per_tok", source),
        moe_router_dtype="fp32",
    )


def _standard_attention(hf: dict, source: str) -> dict:
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        refuse(source, f"sliding_window {hf['sliding_window']}", "full causal attention")
    heads = hf["num_attention_heads"]
    return dict(
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        rotary_base=rope_theta(hf, source),
    )


def mixtral_config(hf: dict, *, source: str, dtype: torch.dtype) -> TransformerConfig:
    fields = _common(hf, source, dtype, experts_key="num_local_experts")
    fields["moe_ffn_hidden_size"] = fields["ffn_hidden_size"]
    return TransformerConfig(**fields, **_standard_attention(hf, source))


def qwen3_moe_config(hf: dict, *, source: str, dtype: torch.dtype) -> TransformerConfig:
    fields = _common(hf, source, dtype, experts_key="num_experts")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    pattern = [
        int(index not in dense and (index + 1) % step == 0) for index in range(fields["num_layers"])
    ]
    return TransformerConfig(
        **fields,
        **_standard_attention(hf, source),
        qk_layernorm=True,
        moe_ffn_hidden_size=required(hf, "moe_intermediate_size", source),
        moe_layer_freq=pattern,
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
    )


def _deepseek_rope(hf: dict, source: str) -> dict:
    theta = rope_theta(hf, source, scaled=("yarn",))
    parameters = rope_parameters(hf)
    if parameters.get("rope_type", parameters.get("type", "default")) == "default":
        return dict(rope_type="rope", rotary_base=theta)
    if parameters.get("attention_factor") is not None or parameters.get("truncate") is False:
        refuse(source, f"yarn {parameters}", "YaRN's attention factor from mscale, truncated")
    mscale = parameters.get("mscale") or 1.0
    mscale_all_dim = parameters.get("mscale_all_dim") or 0.0
    if mscale != 1.0 and not mscale_all_dim:
        refuse(source, f"yarn mscale {mscale} without mscale_all_dim", "transformers ignores it")
    yarn = {key: parameters[key] for key in _YARN_KEYS if parameters.get(key) is not None}
    return dict(
        rope_type="yarn",
        rotary_base=theta,
        rotary_scaling_factor=float(required(yarn, "factor", source)),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        original_max_position_embeddings=int(
            required(yarn, "original_max_position_embeddings", source)
        ),
        beta_fast=float(yarn.get("beta_fast", 32.0)),
        beta_slow=float(yarn.get("beta_slow", 1.0)),
    )


def _deepseek_routing(hf: dict, source: str, topk: int) -> dict:
    if not hf.get("norm_topk_prob", True) and topk > 1:
        refuse(source, "norm_topk_prob false", "sigmoid top-k scores are normalized")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and topk != DEEPSEEK_GROUP_SCORE_EXPERTS * group_topk:
        refuse(
            source,
            f"num_experts_per_tok {topk} with topk_group {group_topk}",
            "a group's score sums its best topk / topk_group experts; transformers sums 2",
        )
    shared = hf.get("n_shared_experts") or 0
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared or None,
    )


def deepseek_v3_config(hf: dict, *, source: str, dtype: torch.dtype) -> TransformerConfig:
    """MTP depths are left off: mtp_depths_in_files adds them when the files hold them."""
    fields = _common(hf, source, dtype, experts_key="n_routed_experts")
    if not hf.get("rope_interleave", True):
        refuse(source, "rope_interleave false", "MLA rotates interleaved channel pairs")
    if fields["layernorm_epsilon"] != DEEPSEEK_LATENT_NORM_EPS:
        refuse(
            source,
            f"rms_norm_eps {fields['layernorm_epsilon']}",
            f"transformers' latent norms keep eps {DEEPSEEK_LATENT_NORM_EPS}, ours use one eps",
        )
    dense = hf.get("first_k_dense_replace", 0)
    fields["moe_ffn_hidden_size"] = required(hf, "moe_intermediate_size", source)
    return TransformerConfig(
        **fields,
        **_deepseek_rope(hf, source),
        **_deepseek_routing(hf, source, fields["moe_router_topk"]),
        moe_layer_freq=[int(index >= dense) for index in range(fields["num_layers"])],
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=required(hf, "kv_lora_rank", source),
        qk_head_dim=required(hf, "qk_nope_head_dim", source),
        qk_pos_emb_head_dim=required(hf, "qk_rope_head_dim", source),
        v_head_dim=required(hf, "v_head_dim", source),
    )


def mtp_depths_in_files(hf: dict, names: set[str]) -> int | None:
    """DeepSeek's published MTP depths (`model.layers.{num_hidden_layers + k - 1}.*`) that the
    files hold: num_nextn_predict_layers when the first depth's eh_proj is there, else None
    (transformers' save_pretrained writes none)."""
    depths = hf.get("num_nextn_predict_layers") or 0
    first = f"model.layers.{hf.get('num_hidden_layers')}.eh_proj.weight"
    return depths if depths and first in names else None


def moe_architecture(config: TransformerConfig) -> str | None:
    """The HF architecture an MoE or MLA model exports to (None: a dense model), or
    ValueError naming what none of them computes."""
    if config.num_moe_experts is None and not config.multi_latent_attention:
        return None
    if config.multi_latent_attention:
        architecture = "deepseek_v3"
    elif config.qk_layernorm:
        architecture = "qwen3_moe"
    else:
        architecture = "mixtral"
    problem = _export_problem(architecture, config)
    if problem:
        raise ValueError(f"cannot export to HuggingFace {architecture}: {problem}")
    return architecture


def _export_problem(architecture: str, c: TransformerConfig) -> str | None:
    if c.normalization != "RMSNorm" or not c.swiglu or c.add_bias_linear:
        return "it needs RMSNorm, --swiglu and --disable-bias-linear"
    if c.num_moe_experts is None or c.moe_shared_expert_gate:
        return "it needs routed experts (--num-experts) and no shared-expert gate"
    if not c.multi_latent_attention and (
        c.position_embedding_type != "rope" or c.rotary_percent != 1.0
    ):
        return "it needs rotary embeddings over whole heads (--position-embedding-type rope)"
    sigmoid = c.moe_router_score_function == "sigmoid"
    if architecture == "deepseek_v3":
        if not (sigmoid and c.moe_router_enable_expert_bias and c.qk_layernorm):
            return "it needs sigmoid routing with expert bias and --qk-layernorm"
        if c.layernorm_epsilon != DEEPSEEK_LATENT_NORM_EPS:
            return f"its latent norms have eps {DEEPSEEK_LATENT_NORM_EPS}"
        if c.moe_router_group_topk and c.moe_router_topk != 2 * c.moe_router_group_topk:
            return "its group score sums each group's best 2 experts"
        pattern = moe_layer_pattern(c)
        if pattern != sorted(pattern):
            return "its dense layers are the first first_k_dense_replace ones"
        return None
    if sigmoid or c.moe_router_topk_scaling_factor not in (None, 1.0):
        return "it routes by softmax with no top-k scaling"
    if c.moe_shared_expert_intermediate_size is not None or c.mtp_num_layers:
        return "it has no shared experts and no multi-token prediction"
    if architecture == "mixtral" and (
        c.moe_router_pre_softmax
        or c.moe_ffn_hidden_size != c.ffn_hidden_size
        or not all(moe_layer_pattern(c))
    ):
        return "it normalizes the top-k probabilities and has MoE in every layer, of one width"
    return None


def _common_hf(config: TransformerConfig, dtype: torch.dtype) -> dict:
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "num_experts_per_tok": config.moe_router_topk,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _standard_hf(config: TransformerConfig) -> dict:
    theta = float(config.rotary_base)
    return {
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "sliding_window": None,
    }


def mixtral_hf_config(config: TransformerConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_common_hf(config, dtype),
        **_standard_hf(config),
        "num_local_experts": config.num_moe_experts,
        "router_jitter_noise": 0.0,
    }


def qwen3_moe_hf_config(config: TransformerConfig, dtype: torch.dtype) -> dict:
    pattern = moe_layer_pattern(config)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_common_hf(config, dtype),
        **_standard_hf(config),
        "use_sliding_window": False,
        "num_experts": config.num_moe_experts,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [index for index, moe in enumerate(pattern) if not moe],
        "norm_topk_prob": not config.moe_router_pre_softmax,
    }


def _deepseek_rope_hf(config: TransformerConfig) -> dict:
    theta = float(config.rotary_base)
    if config.rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": config.rotary_scaling_factor,
        "mscale": config.mscale,
        "mscale_all_dim": config.mscale_all_dim,
        "original_max_position_embeddings": config.original_max_position_embeddings,
        "beta_fast": config.beta_fast,
        "beta_slow": config.beta_slow,
    }


def deepseek_v3_hf_config(config: TransformerConfig, dtype: torch.dtype) -> dict:
    groups = config.moe_router_num_groups if config.moe_router_group_topk else None
    shared = config.moe_shared_expert_intermediate_size or 0
    if shared % config.moe_ffn_hidden_size:
        raise ValueError(
            f"cannot export to HuggingFace deepseek_v3: shared experts of width {shared} are "
            f"not a whole number of experts of width {config.moe_ffn_hidden_size}"
        )
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_common_hf(config, dtype),
        "num_key_value_heads": config.num_attention_heads,
        "rope_parameters": _deepseek_rope_hf(config),
        "rope_interleave": True,
        "n_routed_experts": config.num_moe_experts,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "n_shared_experts": shared // config.moe_ffn_hidden_size,
        "first_k_dense_replace": moe_layer_pattern(config).count(False),
        "n_group": groups or 1,
        "topk_group": config.moe_router_group_topk or 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": config.moe_router_topk_scaling_factor or 1.0,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_head_dim,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim,
        "v_head_dim": config.v_head_dim,
        "num_nextn_predict_layers": config.mtp_num_layers or 0,
    }


KEPT_IN_FP32 = {"deepseek_v3": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}
"""HF tensor names (suffixes) an export writes in fp32 whatever its dtype: the router of
transformers' DeepseekV3 runs in fp32 and keeps these in fp32 when it loads a bf16 model
(`_keep_in_fp32_modules_strict`), as DeepSeek's published bf16 checkpoints store them."""

HF_CONFIGS = {
    "deepseek_v3": deepseek_v3_hf_config,
    "mixtral": mixtral_hf_config,
    "qwen3_moe": qwen3_moe_hf_config,
}
IMPORT_CONFIGS = {
    "deepseek_v3": deepseek_v3_config,
    "mixtral": mixtral_config,
    "qwen3_moe": qwen3_moe_config,
}
