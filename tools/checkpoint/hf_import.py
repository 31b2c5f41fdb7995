"""A HuggingFace model directory (config.json + safetensors or pytorch_model.bin) -> ModelState.

The inverse of hf_export.py, for the architectures our GPTModel computes exactly: DeepSeek-V3,
Mixtral and Qwen3-MoE (`deepseek_v3`, `mixtral`, `qwen3_moe`: hf_moe_configs.py and
hf_moe_layout.py say what maps where), and
  - Llama (`model_type: llama`): RMSNorm, SwiGLU, RoPE with any base, GQA, any head width,
    tied or untied head, attention and MLP biases together or not at all;
  - GPT-2 (`model_type: gpt2`): LayerNorm, exact-erf GeLU (`activation_function: gelu`),
    learned positions, a tied head. GPT-2's own default `gelu_new` is the tanh approximation,
    which our MLP does not compute: such a model is refused rather than imported with different
    logits.
Every tensor of the files must be used and every parameter found, or the import fails naming
the tensor. Nothing is downloaded: the directory is what `save_pretrained` wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.hf_config_keys import refuse, required, rope_theta
from tools.checkpoint.hf_moe_configs import IMPORT_CONFIGS, mtp_depths_in_files
from tools.checkpoint.hf_moe_layout import MOE_ARCHITECTURES, hf_to_ours
from tools.checkpoint.model_state import (
    ConversionError,
    ModelState,
    SourceTensors,
    StateDict,
    check_model_state,
)

# Buffers old transformers versions saved alongside the weights (causal masks, rope
# frequencies): derived values, not parameters.
_DERIVED_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(
            f"{path}: missing; --load-dir must be a HuggingFace model directory (save_pretrained)"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def llama_config(hf_config: dict, *, source: str, dtype: torch.dtype) -> TransformerConfig:
    """TransformerConfig of a Llama config.json (absent optional keys: LlamaConfig defaults)."""
    if hf_config.get("hidden_act", "silu") != "silu":
        refuse(source, f"hidden_act {hf_config['hidden_act']!r}", "SwiGLU uses silu")
    attention_bias = bool(hf_config.get("attention_bias", False))
    if attention_bias != bool(hf_config.get("mlp_bias", False)):
        refuse(
            source,
            f"attention_bias={attention_bias} with mlp_bias={hf_config.get('mlp_bias', False)}",
            "biases are on every Linear or none (--disable-bias-linear)",
        )
    hidden = required(hf_config, "hidden_size", source)
    heads = required(hf_config, "num_attention_heads", source)
    return TransformerConfig(
        num_layers=required(hf_config, "num_hidden_layers", source),
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=required(hf_config, "vocab_size", source),
        max_sequence_length=hf_config.get("max_position_embeddings", 2048),
        ffn_hidden_size=required(hf_config, "intermediate_size", source),
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        kv_channels=hf_config.get("head_dim") or hidden // heads,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config, source),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        swiglu=True,
        add_bias_linear=attention_bias,
        hidden_dropout=0.0,
        attention_dropout=hf_config.get("attention_dropout", 0.0),
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
        init_method_std=hf_config.get("initializer_range", 0.02),
        params_dtype=dtype,
    )


def gpt2_config(hf_config: dict, *, source: str, dtype: torch.dtype) -> TransformerConfig:
    """TransformerConfig of a GPT-2 config.json (absent optional keys: GPT2Config defaults)."""
    activation = hf_config.get("activation_function", "gelu_new")
    if activation != "gelu":
        refuse(source, f"activation_function {activation!r}", "our GeLU is the exact erf form")
    if not hf_config.get("scale_attn_weights", True):
        refuse(source, "scale_attn_weights false", "attention scores are scaled by 1/sqrt(d)")
    if hf_config.get("scale_attn_by_inverse_layer_idx", False):
        refuse(source, "scale_attn_by_inverse_layer_idx", "no per-layer score scaling")
    if hf_config.get("add_cross_attention", False):
        refuse(source, "add_cross_attention", "a decoder-only GPT")
    if not hf_config.get("tie_word_embeddings", True):
        refuse(source, "an untied GPT-2 head", "GPT-2 export and import use the tied head")
    hidden = required(hf_config, "n_embd", source)
    return TransformerConfig(
        num_layers=required(hf_config, "n_layer", source),
        hidden_size=hidden,
        num_attention_heads=required(hf_config, "n_head", source),
        vocab_size=required(hf_config, "vocab_size", source),
        max_sequence_length=required(hf_config, "n_positions", source),
        ffn_hidden_size=hf_config.get("n_inner") or 4 * hidden,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        layernorm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
        add_bias_linear=True,
        hidden_dropout=hf_config.get("resid_pdrop", 0.1),
        attention_dropout=hf_config.get("attn_pdrop", 0.1),
        init_method_std=hf_config.get("initializer_range", 0.02),
        params_dtype=dtype,
    )


def _read_safetensors(paths: list[str]) -> StateDict:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as error:
        raise ImportError("HuggingFace import needs `pip install safetensors`") from error
    tensors: StateDict = {}
    for path in paths:
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: missing; the model directory is incomplete")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{path}: cannot be read ({error})") from None
    return tensors


def read_hf_tensors(directory: str) -> StateDict:
    """All tensors of model.safetensors (or its sharded index, or pytorch_model.bin)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _read_safetensors([single])
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConversionError(f"{index}: not a safetensors index ({error})") from None
        return _read_safetensors([os.path.join(directory, shard) for shard in shards])
    legacy = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(legacy):
        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many types for truncated or foreign files
            raise ConversionError(f"{legacy}: cannot be read ({type(error).__name__})") from None
        return dict(tensors)
    raise ConversionError(
        f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def llama_to_ours(files: SourceTensors, config: TransformerConfig) -> StateDict:
    ours = {
        "embedding.word_embeddings.weight": files.take("model.embed_tokens.weight"),
        "decoder.final_norm.weight": files.take("model.norm.weight"),
    }
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = files.take("lm_head.weight")
    elif "lm_head.weight" in files.tensors:  # some writers keep the tied copy
        if not torch.equal(files.take("lm_head.weight"), ours["embedding.word_embeddings.weight"]):
            raise ConversionError(
                f"{files.source}: lm_head.weight differs from model.embed_tokens.weight but "
                "config.json says tie_word_embeddings"
            )
    suffixes = ("weight", "bias") if config.add_bias_linear else ("weight",)
    for index in range(config.num_layers):
        theirs, mine = f"model.layers.{index}.", f"decoder.layers.{index}."
        ours[f"{mine}input_layernorm.weight"] = files.take(f"{theirs}input_layernorm.weight")
        ours[f"{mine}pre_mlp_layernorm.weight"] = files.take(
            f"{theirs}post_attention_layernorm.weight"
        )
        for suffix in suffixes:
            q, k, v = (files.take(f"{theirs}self_attn.{p}_proj.{suffix}") for p in "qkv")
            ours[f"{mine}self_attention.linear_qkv.{suffix}"] = torch.cat([q, k, v])
            ours[f"{mine}self_attention.linear_proj.{suffix}"] = files.take(
                f"{theirs}self_attn.o_proj.{suffix}"
            )
            gate = files.take(f"{theirs}mlp.gate_proj.{suffix}")
            ours[f"{mine}mlp.linear_fc1.{suffix}"] = torch.cat(
                [gate, files.take(f"{theirs}mlp.up_proj.{suffix}")]
            )
            ours[f"{mine}mlp.linear_fc2.{suffix}"] = files.take(f"{theirs}mlp.down_proj.{suffix}")
    return ours


def gpt2_to_ours(files: SourceTensors, config: TransformerConfig) -> StateDict:
    """GPT-2's Conv1D weights are [in, out]: transposed to nn.Linear's [out, in]."""
    if not any(name.startswith("transformer.") for name in files.tensors):
        # The original OpenAI checkpoints name the transformer's tensors without the prefix.
        files.tensors = {f"transformer.{name}": tensor for name, tensor in files.tensors.items()}
    embedding = files.take("transformer.wte.weight")
    ours = {
        "embedding.word_embeddings.weight": embedding,
        "embedding.position_embeddings.weight": files.take("transformer.wpe.weight"),
        "decoder.final_norm.weight": files.take("transformer.ln_f.weight"),
        "decoder.final_norm.bias": files.take("transformer.ln_f.bias"),
    }
    for name in ("lm_head.weight", "transformer.lm_head.weight"):
        if name in files.tensors and not torch.equal(files.take(name), embedding):
            raise ConversionError(f"{files.source}: {name} differs from the tied embedding")
    conv1d = {
        "self_attention.linear_qkv": "attn.c_attn",
        "self_attention.linear_proj": "attn.c_proj",
        "mlp.linear_fc1": "mlp.c_fc",
        "mlp.linear_fc2": "mlp.c_proj",
    }
    for index in range(config.num_layers):
        theirs, mine = f"transformer.h.{index}.", f"decoder.layers.{index}."
        for our_norm, their_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for suffix in ("weight", "bias"):
                ours[f"{mine}{our_norm}.{suffix}"] = files.take(f"{theirs}{their_norm}.{suffix}")
        for our_linear, their_module in conv1d.items():
            weight = files.take(f"{theirs}{their_module}.weight")
            ours[f"{mine}{our_linear}.weight"] = weight.t().contiguous()
            ours[f"{mine}{our_linear}.bias"] = files.take(f"{theirs}{their_module}.bias")
    return ours


_ARCHITECTURES = {
    "llama": (llama_config, llama_to_ours),
    "gpt2": (gpt2_config, gpt2_to_ours),
    **{
        name: (IMPORT_CONFIGS[name], functools.partial(hf_to_ours, name))
        for name in MOE_ARCHITECTURES
    },
}


def load_hf(load_dir: str) -> ModelState:
    """Read and check a HuggingFace directory; ConversionError names what does not fit."""
    hf_config = read_hf_config(load_dir)
    config_path = os.path.join(load_dir, "config.json")
    model_type = hf_config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ConversionError(
            f"{config_path}: model_type {model_type!r} is not one the hf loader reads "
            f"({', '.join(sorted(_ARCHITECTURES))})"
        )
    tensors = read_hf_tensors(load_dir)
    dtypes = {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    to_config, to_ours = _ARCHITECTURES[model_type]
    config = to_config(hf_config, source=config_path, dtype=dtype)
    if model_type == "deepseek_v3":
        depths = mtp_depths_in_files(hf_config, set(tensors))
        config = dataclasses.replace(config, mtp_num_layers=depths)
    weights = {name: t for name, t in tensors.items() if not name.endswith(_DERIVED_BUFFERS)}
    files = SourceTensors(weights, source=load_dir)
    state = ModelState(state_dict=to_ours(files, config), config=config)
    files.check_all_used()
    check_model_state(state, source=load_dir)
    return state
