"""Our GPTModel's state dict -> a HuggingFace model directory (config.json + model.safetensors).

Two HuggingFace architectures cover what our GPTModel builds without approximation:
  - LlamaForCausalLM for RMSNorm + SwiGLU + RoPE models (GQA, any head width, tied or untied
    head; linear biases map to Llama's attention_bias + mlp_bias, which cover the same Linears);
  - GPT2LMHeadModel for LayerNorm + GeLU + learned-position models with plain multi-head
    attention and a tied head (a model without biases is exported with zero biases).
  - DeepseekV3ForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM for MoE and
    multi-latent-attention models (hf_moe_configs.py picks and checks, hf_moe_layout.py maps;
    the files hold one tensor per expert, as save_pretrained writes them).
Anything else fails with a message naming the feature HuggingFace's architecture lacks.

    python3 tools/checkpoint/convert.py --loader megatron_fp8 --saver hf --load-dir CKPT_DIR \
        --save-dir HF_DIR        (or its alias: convert_to_hf.py --load CKPT_DIR --output HF_DIR)

then `AutoModelForCausalLM.from_pretrained(HF_DIR)`. HF_DIR is written as `HF_DIR.tmp` and renamed
when complete (a previous export there is replaced only then), so it never holds a half-written
model. Our checkpoints are read through megatron.training.checkpoint.load_state_for_export
(full fp32 parameters, from any checkpoint format and data-parallel size), so FP8 training
checkpoints export their fp32 main weights. hf_import.py is the inverse.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable

import torch

from megatron.core.checkpoint_files import TMP_SUFFIX, fsync_tree, publish_dir
from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.hf_moe_configs import HF_CONFIGS, KEPT_IN_FP32, moe_architecture
from tools.checkpoint.hf_moe_layout import ours_to_hf
from tools.checkpoint.hf_tokenizer import TOKENIZER_FILES
from tools.checkpoint.model_state import buffer_shapes, expected_shapes

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


class UnsupportedArchitectureError(ValueError):
    """The model uses a feature the target HuggingFace architecture cannot express."""


def _fail(architecture: str, feature: str, fix: str) -> None:
    raise UnsupportedArchitectureError(
        f"cannot export to HuggingFace {architecture}: it has no {feature}; {fix}"
    )


def check_llama_exportable(config: TransformerConfig) -> None:
    """Raise UnsupportedArchitectureError naming the first feature LlamaForCausalLM lacks."""
    if config.normalization != "RMSNorm":
        _fail("LlamaForCausalLM", f"{config.normalization}", "Llama export needs RMSNorm")
    if not config.swiglu:
        _fail("LlamaForCausalLM", "GeLU MLP (it uses SwiGLU)", "train with --swiglu")
    if config.position_embedding_type != "rope":
        _fail(
            "LlamaForCausalLM",
            "learned absolute position embeddings (it uses rotary embeddings)",
            "train with --position-embedding-type rope, or use LayerNorm + GeLU for GPT-2 export",
        )
    if config.rotary_percent != 1.0:
        _fail(
            "LlamaForCausalLM",
            f"partial rotary embeddings (rotary_percent={config.rotary_percent})",
            "train with --rotary-percent 1.0",
        )


def check_gpt2_exportable(config: TransformerConfig) -> None:
    """Raise UnsupportedArchitectureError naming the first feature GPT2LMHeadModel lacks."""
    if config.normalization != "LayerNorm":
        _fail("GPT2LMHeadModel", f"{config.normalization}", "GPT-2 export needs LayerNorm")
    if config.swiglu:
        _fail(
            "GPT2LMHeadModel",
            "SwiGLU MLP",
            "use RMSNorm + rope for Llama export",
        )
    if config.position_embedding_type != "learned_absolute":
        _fail(
            "GPT2LMHeadModel",
            "rotary position embeddings (rope)",
            "use RMSNorm + SwiGLU for Llama export",
        )
    if config.num_query_groups != config.num_attention_heads:
        _fail(
            "GPT2LMHeadModel",
            f"grouped-query attention (num_query_groups={config.num_query_groups} < "
            f"num_attention_heads={config.num_attention_heads})",
            "use the Llama layout (RMSNorm + SwiGLU + rope) for GQA models",
        )
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        _fail(
            "GPT2LMHeadModel",
            f"head width kv_channels={config.kv_channels} != hidden_size / heads",
            "drop --kv-channels",
        )
    if config.untie_embeddings_and_output_weights:
        _fail(
            "GPT2LMHeadModel",
            "untied output layer (its head is always the embedding table)",
            "train without --untie-embeddings-and-output-weights",
        )


EXPORTED = "Llama, GPT-2, Mixtral, Qwen3-MoE, DeepSeek-V3"


def check_any_exportable(config: TransformerConfig) -> None:
    """Raise UnsupportedArchitectureError for what no exported architecture computes: muP's
    attention scale and multipliers, YaRN outside latent attention (DeepSeek-V3's own)."""
    feature, fix = None, None
    if config.use_mup:
        feature = "muP (an attention scale of 1/head dim, embedding and output multipliers)"
        fix = "export a model trained without --use-mup"
    elif config.rope_type == "yarn" and not config.multi_latent_attention:
        feature = "YaRN rotary scaling outside latent attention"
        fix = "train with --rope-type rope (YaRN exports with --multi-latent-attention)"
    if feature:
        raise UnsupportedArchitectureError(
            f"cannot export to HuggingFace: none of its architectures here ({EXPORTED}) has "
            f"{feature}; {fix}"
        )


def hf_architecture(config: TransformerConfig) -> str:
    """ "deepseek_v3", "mixtral" or "qwen3_moe" for MoE and latent-attention models
    (hf_moe_configs.moe_architecture), else "llama" or "gpt2": picked by the norm, then checked
    feature by feature."""
    check_any_exportable(config)
    try:
        moe = moe_architecture(config)
    except ValueError as error:
        raise UnsupportedArchitectureError(str(error)) from None
    if moe is not None:
        return moe
    if config.normalization == "RMSNorm":
        check_llama_exportable(config)
        return "llama"
    check_gpt2_exportable(config)
    return "gpt2"


def _expected_names(config: TransformerConfig) -> set[str]:
    """Parameter names of our GPTModel for `config` (see megatron/core/models/gpt)."""
    names = {"embedding.word_embeddings.weight", "decoder.final_norm.weight"}
    if config.position_embedding_type == "learned_absolute":
        names.add("embedding.position_embeddings.weight")
    if config.untie_embeddings_and_output_weights:
        names.add("output_layer.weight")
    if config.normalization == "LayerNorm":
        names.add("decoder.final_norm.bias")
    for index in range(config.num_layers):
        prefix = f"decoder.layers.{index}."
        norms = ("input_layernorm", "pre_mlp_layernorm")
        linears = ("self_attention.linear_qkv", "self_attention.linear_proj")
        linears += ("mlp.linear_fc1", "mlp.linear_fc2")
        names.update(f"{prefix}{norm}.weight" for norm in norms)
        names.update(f"{prefix}{linear}.weight" for linear in linears)
        if config.normalization == "LayerNorm":
            names.update(f"{prefix}{norm}.bias" for norm in norms)
        if config.add_bias_linear:
            names.update(f"{prefix}{linear}.bias" for linear in linears)
    return names


def check_state_dict(state_dict: StateDict, config: TransformerConfig) -> None:
    """The state dict must hold exactly our model's parameters for `config`."""
    expected = _expected_names(config)
    if moe_architecture(config) is not None:
        expected = set(expected_shapes(config)) | set(buffer_shapes(config))
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; pass the config saved with the checkpoint"
        )


def _linear_bias(
    state_dict: StateDict, name: str, out_features: int, config: TransformerConfig
) -> Tensor:
    """The bias of a Linear, or zeros when the model has none (GPT-2 always has biases)."""
    if config.add_bias_linear:
        return state_dict[f"{name}.bias"]
    return torch.zeros(out_features, dtype=state_dict[f"{name}.weight"].dtype)


def _split_qkv(qkv: Tensor, config: TransformerConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Split along dim 0 by our fused layout [q heads | k groups | v groups]."""
    q_rows = config.num_attention_heads * config.kv_channels
    kv_rows = config.num_query_groups * config.kv_channels
    if qkv.shape[0] != q_rows + 2 * kv_rows:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} output rows; the config implies "
            f"{q_rows} + 2 x {kv_rows}: pass the config saved with the checkpoint"
        )
    q, k, v = torch.split(qkv, [q_rows, kv_rows, kv_rows], dim=0)
    return q, k, v


def llama_state_dict(state_dict: StateDict, config: TransformerConfig) -> StateDict:
    """Our parameter names -> LlamaForCausalLM's. fc1 rows are [gate | up] (see mlp.py)."""
    hf = {
        "model.embed_tokens.weight": state_dict["embedding.word_embeddings.weight"],
        "model.norm.weight": state_dict["decoder.final_norm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = state_dict["output_layer.weight"]
    suffixes = ("weight", "bias") if config.add_bias_linear else ("weight",)
    for index in range(config.num_layers):
        ours, theirs = f"decoder.layers.{index}.", f"model.layers.{index}."
        hf[f"{theirs}input_layernorm.weight"] = state_dict[f"{ours}input_layernorm.weight"]
        hf[f"{theirs}post_attention_layernorm.weight"] = state_dict[
            f"{ours}pre_mlp_layernorm.weight"
        ]
        for suffix in suffixes:
            q, k, v = _split_qkv(state_dict[f"{ours}self_attention.linear_qkv.{suffix}"], config)
            gate, up = state_dict[f"{ours}mlp.linear_fc1.{suffix}"].chunk(2, dim=0)
            hf[f"{theirs}self_attn.q_proj.{suffix}"] = q
            hf[f"{theirs}self_attn.k_proj.{suffix}"] = k
            hf[f"{theirs}self_attn.v_proj.{suffix}"] = v
            hf[f"{theirs}self_attn.o_proj.{suffix}"] = state_dict[
                f"{ours}self_attention.linear_proj.{suffix}"
            ]
            hf[f"{theirs}mlp.gate_proj.{suffix}"] = gate
            hf[f"{theirs}mlp.up_proj.{suffix}"] = up
            hf[f"{theirs}mlp.down_proj.{suffix}"] = state_dict[f"{ours}mlp.linear_fc2.{suffix}"]
    return hf


def gpt2_state_dict(state_dict: StateDict, config: TransformerConfig) -> StateDict:
    """Our parameter names -> GPT2LMHeadModel's. GPT-2's Conv1D stores weights as [in, out],
    the transpose of nn.Linear's [out, in]; c_attn is the fused [q | k | v], the same order."""
    hf = {
        "transformer.wte.weight": state_dict["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state_dict["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state_dict["decoder.final_norm.weight"],
        "transformer.ln_f.bias": state_dict["decoder.final_norm.bias"],
    }
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    conv1d = {  # ours -> (GPT-2 module, output features)
        "self_attention.linear_qkv": ("attn.c_attn", 3 * hidden),
        "self_attention.linear_proj": ("attn.c_proj", hidden),
        "mlp.linear_fc1": ("mlp.c_fc", ffn),
        "mlp.linear_fc2": ("mlp.c_proj", hidden),
    }
    for index in range(config.num_layers):
        ours, theirs = f"decoder.layers.{index}.", f"transformer.h.{index}."
        for our_norm, their_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            hf[f"{theirs}{their_norm}.weight"] = state_dict[f"{ours}{our_norm}.weight"]
            hf[f"{theirs}{their_norm}.bias"] = state_dict[f"{ours}{our_norm}.bias"]
        for our_linear, (their_module, out_features) in conv1d.items():
            weight = state_dict[f"{ours}{our_linear}.weight"]
            if weight.shape[0] != out_features:
                raise ValueError(
                    f"{ours}{our_linear}.weight has shape {tuple(weight.shape)}, expected "
                    f"{out_features} output rows: pass the config saved with the checkpoint"
                )
            hf[f"{theirs}{their_module}.weight"] = weight.t()
            hf[f"{theirs}{their_module}.bias"] = _linear_bias(
                state_dict, f"{ours}{our_linear}", out_features, config
            )
    return hf


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def llama_config(config: TransformerConfig, dtype: torch.dtype) -> dict:
    """config.json of LlamaForCausalLM (keys read by transformers 4.4x and 5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        # transformers < 5 reads rope_theta; 5.x reads rope_parameters (and folds rope_theta in).
        "rope_theta": float(config.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base)},
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": _dtype_name(dtype),
    }


def gpt2_config(config: TransformerConfig, dtype: torch.dtype) -> dict:
    """config.json of GPT2LMHeadModel."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "n_positions": config.max_sequence_length,
        "layer_norm_epsilon": config.layernorm_epsilon,
        # Ours is exact erf GeLU; GPT-2's default "gelu_new" is the tanh approximation.
        "activation_function": "gelu",
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": _dtype_name(dtype),
    }


EXPORTED_FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES)
CONVERTERS: dict[str, tuple[Callable, Callable]] = {
    "llama": (llama_state_dict, llama_config),
    "gpt2": (gpt2_state_dict, gpt2_config),
    **{name: (functools.partial(ours_to_hf, name), HF_CONFIGS[name]) for name in HF_CONFIGS},
}


def convert_state_dict_to_hf(
    state_dict: StateDict,
    config: TransformerConfig,
    *,
    output_dir: str,
    dtype: torch.dtype = torch.float32,
    write_extra: Callable[[str], None] | None = None,
) -> dict:
    """Write `output_dir`/config.json and model.safetensors (under `output_dir.tmp`, renamed
    when complete); returns the config dict.

    `state_dict` holds full (unsharded) parameters by our GPTModel's parameter names;
    `write_extra` adds files (the tokenizer, hf_tokenizer.py) to the directory before it is
    published.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ImportError("HuggingFace export needs `pip install safetensors`") from error
    architecture = hf_architecture(config)
    check_state_dict(state_dict, config)
    to_state_dict, to_config = CONVERTERS[architecture]
    fp32_names = KEPT_IN_FP32.get(architecture, ())
    # clone(): split/transposed views share storage, which safetensors refuses to save.
    tensors = {
        name: tensor.detach()
        .to(device="cpu", dtype=torch.float32 if name.endswith(fp32_names) else dtype)
        .contiguous()
        .clone()
        for name, tensor in to_state_dict(state_dict, config).items()
    }
    hf_config = to_config(config, dtype)
    check_output_dir(output_dir)
    tmp = f"{os.path.normpath(output_dir)}{TMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    os.makedirs(tmp)
    # The "format" metadata is how transformers recognizes a PyTorch safetensors file.
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as config_file:
        json.dump(hf_config, config_file, indent=2, sort_keys=True)
        config_file.write("\n")
    if write_extra is not None:
        write_extra(tmp)
    fsync_tree(tmp)
    publish_dir(tmp, os.path.normpath(output_dir))
    return hf_config


def check_output_dir(output_dir: str) -> None:
    """A re-export replaces the whole directory: refuse one that holds files we did not write."""
    if not os.path.exists(output_dir):
        return
    if not os.path.isdir(output_dir):
        raise FileExistsError(f"--output {output_dir} is a file; pass a directory path.")
    others = sorted(set(os.listdir(output_dir)) - set(EXPORTED_FILES))
    if others:
        raise FileExistsError(
            f"--output {output_dir} holds files an export does not write ({others[:5]}), which "
            "replacing the directory would delete; pass a new or empty --output directory."
        )
