"""Megatron-LM (megatron-core) `torch_dist` checkpoints of GPT models <-> ModelState.

Facts of megatron-core's layout (read off megatron-core 0.16.1, models/gpt and transformer/):
  - Transformer tensors are stacked over layers under one key: `decoder.layers.<module>.weight`
    has shape [num_layers, ...] (the layer index is a leading sharded axis).
  - linear_qkv's output rows are grouped per query group g: [q of the group's heads | k_g | v_g],
    ng * (heads/ng + 2) * d rows; ours is [all q | all k | all v].
  - linear_fc1 under SwiGLU is [gate; up], gate first, as ours.
  - Pre-attention and pre-MLP norms are stored under the names of the TE spec's fused
    LayerNormLinear, `self_attention.linear_qkv.layer_norm_weight` (and `_bias`) and
    `mlp.linear_fc1.layer_norm_weight`, by both the TE and the local spec (the local spec's
    sharded_state_dict maps its separate `input_layernorm`/`pre_mlp_layernorm` onto them);
    the loader also accepts the local spec's own names. The final norm is
    `decoder.final_layernorm`.
  - Each Linear also stores a pickled `_extra_state` object per layer (None in the local spec),
    which megatron-core's loader asks for: the saver writes that None.
  - common.pt holds the args Namespace, `iteration` and `checkpoint_version`; a converted model
    is saved as iteration "release", as Megatron-LM's converters do.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint import mcore_files
from tools.checkpoint.model_flags import config_from_megatron_args
from tools.checkpoint.model_state import (
    ConversionError,
    ModelState,
    SourceTensors,
    StateDict,
    check_model_state,
    write_dir_atomically,
)

LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# (our norm, megatron-core's TE-spec name, its local-spec name), per layer.
LAYER_NORMS = (
    ("input_layernorm", "self_attention.linear_qkv.layer_norm", "input_layernorm"),
    ("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm", "pre_mlp_layernorm"),
)
# State that is not the model's (optimizer, RNG, rerun machine): left in the checkpoint.
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine")
# Megatron-LM args whose non-default values our GPTModel does not compute.
UNSUPPORTED_ARGS = {
    "rotary_interleaved": False,
    "apply_layernorm_1p": False,
    "qk_layernorm": False,
    "num_experts": None,
    "squared_relu": False,
    "multi_latent_attention": False,
    "use_rope_scaling": False,
    "softmax_scale": None,
    "attention_output_gate": False,
    "mtp_num_layers": None,
}


def qkv_mcore_to_ours(qkv: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Rows [per group: q_g | k_g | v_g] -> [q | k | v] (weights [rows, in] or biases [rows])."""
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
    return torch.cat([part.reshape(-1, *qkv.shape[1:]) for part in (q, k, v)])


def qkv_ours_to_mcore(qkv: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups * d
    q, k, v = torch.split(qkv, [groups * per_group, groups * d, groups * d])
    parts = [t.reshape(groups, -1, *qkv.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(qkv.shape)


def _check_supported(args: dict, source: str) -> None:
    for name, supported in UNSUPPORTED_ARGS.items():
        if args.get(name, supported) not in (supported, None, False):
            raise ConversionError(
                f"{source}: saved with {name}={args[name]!r}, which our GPTModel does not compute"
            )
    if args.get("add_qkv_bias") and not args.get("add_bias_linear", True):
        raise ConversionError(
            f"{source}: saved with add_qkv_bias and without add_bias_linear (a bias on linear_qkv "
            "only); our Linears have biases on all or none"
        )
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ConversionError(
            f"{source}: position_embedding_type {position!r}; ours is learned_absolute or rope"
        )


def _mcore_to_ours(files: SourceTensors, config: TransformerConfig) -> StateDict:
    ours = {"embedding.word_embeddings.weight": files.take("embedding.word_embeddings.weight")}
    if config.position_embedding_type == "learned_absolute":
        ours["embedding.position_embeddings.weight"] = files.take(
            "embedding.position_embeddings.weight"
        )
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = files.take("output_layer.weight")
    norm_suffixes = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    for suffix in norm_suffixes:
        ours[f"decoder.final_norm.{suffix}"] = files.take(f"decoder.final_layernorm.{suffix}")
    stacked: dict[str, torch.Tensor] = {}
    for our_norm, te_name, local_name in LAYER_NORMS:
        for suffix in norm_suffixes:
            stacked[f"{our_norm}.{suffix}"] = files.take(
                f"decoder.layers.{te_name}_{suffix}", f"decoder.layers.{local_name}.{suffix}"
            )
    linear_suffixes = ("weight", "bias") if config.add_bias_linear else ("weight",)
    for linear in LINEARS:
        for suffix in linear_suffixes:
            stacked[f"{linear}.{suffix}"] = files.take(f"decoder.layers.{linear}.{suffix}")
    for name, tensor in stacked.items():
        if tensor.shape[0] != config.num_layers:
            raise ConversionError(
                f"{files.source}: decoder.layers.{name} stacks {tensor.shape[0]} layers, the "
                f"args say num_layers={config.num_layers}"
            )
        for index in range(config.num_layers):
            layer = tensor[index]
            if name.startswith("self_attention.linear_qkv"):
                layer = qkv_mcore_to_ours(layer, config)
            ours[f"decoder.layers.{index}.{name}"] = layer.clone()
    return ours


def load_mcore(load_dir: str, given_flags: dict) -> ModelState:
    directory = mcore_files.resolve_iteration_dir(load_dir)
    mcore_files.check_backend(directory)
    common = mcore_files.read_common(directory)
    recorded = mcore_files.saved_args(common)
    source = os.path.join(directory, "common.pt")
    _check_supported(recorded, source)
    shapes = {
        key: value
        for key, value in mcore_files.tensor_shapes(directory).items()
        if not key.startswith(NOT_MODEL)
    }
    embedding = shapes.get("embedding.word_embeddings.weight")
    qkv = shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    if embedding is None or qkv is None:
        raise ConversionError(
            f"{directory}: no embedding.word_embeddings.weight or stacked "
            "decoder.layers.self_attention.linear_qkv.weight; not a megatron-core GPT checkpoint"
        )
    config = config_from_megatron_args(
        {**given_flags, **recorded},
        source=source if recorded else f"{source} (no saved args) and the command line",
        padded_vocab_size=embedding[0][0],
        num_layers=qkv[0][0],
    )
    files = SourceTensors(mcore_files.read_tensors(directory, shapes), source=directory)
    dtypes = {tensor.dtype for tensor in files.tensors.values()}
    if len(dtypes) == 1:
        config.params_dtype = dtypes.pop()
    state = ModelState(
        state_dict=_mcore_to_ours(files, config),
        config=config,
        iteration=int(common.get("iteration", 0) or 0),
    )
    files.check_all_used()
    check_model_state(state, source=directory)
    return state


def megatron_args(config: TransformerConfig, iteration: int) -> argparse.Namespace:
    """The args Megatron-LM records (its names) for `config`: what --use-checkpoint-args and
    the checkpoint converters of Megatron-LM read."""
    rope = config.position_embedding_type == "rope"
    return argparse.Namespace(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        max_position_embeddings=config.max_sequence_length,
        seq_length=config.max_sequence_length,
        position_embedding_type=config.position_embedding_type,
        use_rotary_position_embeddings=rope,
        add_position_embedding=not rope,
        rotary_base=config.rotary_base,
        rotary_percent=config.rotary_percent,
        rotary_interleaved=False,
        normalization=config.normalization,
        norm_epsilon=config.layernorm_epsilon,
        apply_layernorm_1p=False,
        qk_layernorm=False,
        swiglu=config.swiglu,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_bias_linear,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        padded_vocab_size=config.vocab_size,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        params_dtype=config.params_dtype,
        bf16=config.params_dtype == torch.bfloat16,
        fp16=config.params_dtype == torch.float16,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_format="torch_dist",
        iteration=iteration,
    )


def _extra_state() -> list:
    """megatron-core stores a ShardedObject as torch.save of the list of its pieces' data; DCP
    torch.saves a non-tensor value itself, so this list becomes the same bytes."""
    return [None]


def mcore_state_dict(state: ModelState) -> dict:
    """Our parameters -> megatron-core's torch_dist keys and layout (layer-stacked)."""
    config, ours = state.config, state.state_dict
    layers = config.num_layers
    out: dict = {"embedding.word_embeddings.weight": ours["embedding.word_embeddings.weight"]}
    if config.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = ours["embedding.position_embeddings.weight"]
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = ours["output_layer.weight"]
    norm_suffixes = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    for suffix in norm_suffixes:
        out[f"decoder.final_layernorm.{suffix}"] = ours[f"decoder.final_norm.{suffix}"]
        for our_norm, te_name, _ in LAYER_NORMS:
            out[f"decoder.layers.{te_name}_{suffix}"] = torch.stack(
                [ours[f"decoder.layers.{i}.{our_norm}.{suffix}"] for i in range(layers)]
            )
    linear_suffixes = ("weight", "bias") if config.add_bias_linear else ("weight",)
    for linear in LINEARS:
        for suffix in linear_suffixes:
            per_layer = [ours[f"decoder.layers.{i}.{linear}.{suffix}"] for i in range(layers)]
            if linear == "self_attention.linear_qkv":
                per_layer = [qkv_ours_to_mcore(t, config) for t in per_layer]
            out[f"decoder.layers.{linear}.{suffix}"] = torch.stack(per_layer)
        for index in range(layers):
            out[f"decoder.layers.{linear}._extra_state/shard_{index}_{layers}"] = _extra_state()
    return {
        key: value.detach().cpu().contiguous().clone() if isinstance(value, torch.Tensor) else value
        for key, value in out.items()
    }


def check_mcore_savable(config: TransformerConfig) -> None:
    """The saver writes dense GPT layers only: MoE, latent attention, QK norm and MTP models
    are refused before anything is written (the hf saver writes them), and so are muP and YaRN,
    which its Megatron-LM args do not record (a model built from them would differ)."""
    features = {
        "MoE layers": config.num_moe_experts is not None,
        "multi-latent attention": config.multi_latent_attention,
        "QK norm": config.qk_layernorm,
        "multi-token prediction": bool(config.mtp_num_layers),
        "muP": config.use_mup,
        "YaRN rotary scaling": config.rope_type == "yarn",
    }
    present = [name for name, used in features.items() if used]
    if present:
        raise ConversionError(
            f"the mcore saver writes dense GPT models; this one has {', '.join(present)}: "
            "use --saver megatron_fp8 (--saver hf also writes MoE, latent-attention, QK-norm "
            "and MTP models)"
        )


def save_mcore(state: ModelState, save_dir: str) -> None:
    """A Megatron-LM --save directory: tracker + one torch_dist iteration directory."""
    check_model_state(state, source="the converted model")
    check_mcore_savable(state.config)
    tensors = mcore_state_dict(state)
    name = f"iter_{state.iteration:07d}" if state.iteration > 0 else "release"
    tracker = str(state.iteration) if state.iteration > 0 else "release"

    def write(tmp: str) -> None:
        directory = os.path.join(tmp, name)
        os.makedirs(directory)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no process group: one process"
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
        common = {
            "args": megatron_args(state.config, state.iteration),
            "checkpoint_version": 3.0,
            "iteration": state.iteration,
        }
        torch.save(common, os.path.join(directory, "common.pt"))
        with open(os.path.join(directory, "metadata.json"), "w") as handle:
            json.dump(mcore_files.BACKENDS, handle)
        with open(os.path.join(tmp, mcore_files.TRACKER), "w") as handle:
            handle.write(tracker)

    write_dir_atomically(save_dir, write)
