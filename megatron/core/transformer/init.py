"""Deterministic, sharding-independent parameter initialization.

Each parameter's value is a function of (seed, its qualified name) only: a private
torch.Generator is seeded from a hash of both and draws on CPU in fp32, then the result is cast
into the target tensor. So a parameter gets the same value whether the model is built eagerly,
on meta and materialized unit by unit, on any device, or with other parameters absent.
"""

from __future__ import annotations

import hashlib

import torch

from megatron.core.transformer import mup
from megatron.core.transformer.transformer_config import TransformerConfig

# Modules whose `.weight` is a norm scale (initialized to one).
# (q_layernorm, k_layernorm, kv_layernorm: --qk-layernorm and multi-latent attention;
# enorm, hnorm, final_layernorm: the multi-token prediction layers.)
NORM_MODULE_NAMES = frozenset(
    {
        "input_layernorm",
        "pre_mlp_layernorm",
        "final_norm",
        "q_layernorm",
        "k_layernorm",
        "kv_layernorm",
        "enorm",
        "hnorm",
        "final_layernorm",
    }
)
# Linears that write into the residual stream: std scaled by 1/sqrt(2 * num_layers) because
# each of the 2 * num_layers residual adds contributes variance (GPT-2, Megatron-LM).
RESIDUAL_OUTPUT_MODULE_NAMES = frozenset({"linear_proj", "linear_fc2"})
# Weights drawn from normal(0, init_method_std).
# (`router` is the MoE gating weight, `linear_gate` the shared experts' gate; MoE experts' stacked
# weights are named linear_fc1 / linear_fc2 like the dense MLP's.)
PLAIN_NORMAL_MODULE_NAMES = frozenset(
    {
        "word_embeddings",
        "position_embeddings",
        "linear_qkv",
        "linear_fc1",
        "output_layer",
        "router",
        "linear_gate",
        "linear_q_proj",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "eh_proj",
    }
)
# Weights that keep the base std under muP (Megatron-LM: embeddings and the untied output layer).
EMBEDDING_CLASS_MODULE_NAMES = frozenset({"word_embeddings", "position_embeddings", "output_layer"})
# First component of every GPTModel parameter name; anything before it is a wrapper prefix.
_ROOT_NAMES = ("embedding", "decoder", "output_layer", "mtp")


def canonical_parameter_name(name: str) -> str:
    """Strip wrapper prefixes ('module.', '_orig_mod.', ...) so that the seed, and thus the
    value, does not depend on how the model is wrapped."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part in _ROOT_NAMES:
            return ".".join(parts[index:])
    raise ValueError(
        f"init_parameter_: {name!r} is not a GPTModel parameter name; names start with one of "
        f"{_ROOT_NAMES} (as in GPTModel.named_parameters()), optionally after wrapper prefixes"
    )


def parameter_seed(seed: int, name: str) -> int:
    """64-bit generator seed for parameter `name` under global `seed`."""
    digest = hashlib.sha256(f"{seed}:{canonical_parameter_name(name)}".encode()).digest()
    # torch.Generator.manual_seed accepts values below 2^63 on every version.
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_rule(name: str, config: TransformerConfig) -> tuple[str, float]:
    """('zeros' | 'ones' | 'normal', std) for parameter `name`."""
    parts = canonical_parameter_name(name).split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        raise ValueError(f"init_parameter_: {name!r} does not end in '.weight' or '.bias'")
    module_name = parts[-2]
    if parts[-1] == "bias":
        return "zeros", 0.0
    if module_name in NORM_MODULE_NAMES:
        # --apply-layernorm-1p stores scale - 1, which starts at 0.
        return ("zeros" if config.apply_layernorm_1p else "ones"), 0.0
    if module_name in RESIDUAL_OUTPUT_MODULE_NAMES:
        return "normal", mup.init_std(config, residual_output=True, embedding=False)
    if module_name in PLAIN_NORMAL_MODULE_NAMES:
        embedding = module_name in EMBEDDING_CLASS_MODULE_NAMES
        return "normal", mup.init_std(config, residual_output=False, embedding=embedding)
    raise ValueError(
        f"init_parameter_: no init rule for {name!r}; add its module name to one of the rule "
        "sets in megatron/core/transformer/init.py"
    )


@torch.no_grad()
def init_parameter_(
    tensor: torch.Tensor, *, name: str, config: TransformerConfig, seed: int
) -> None:
    """Fill `tensor` in place with the initial value of GPTModel parameter `name`.

    `tensor` must have the parameter's full shape (a shard owner draws the full tensor and
    slices it). Rules: norm weights 1 (0 with apply_layernorm_1p), biases 0, embeddings and
    Linear weights normal(0, init_method_std), attention/MLP output projections
    normal(0, init_method_std / sqrt(2 * num_layers)); under muP the non-embedding weights'
    std is further divided by sqrt(width mult) (mup.init_std). Meta tensors are left alone.
    """
    kind, std = _init_rule(name, config)
    if tensor.is_meta:
        return
    if kind == "zeros":
        tensor.zero_()
        return
    if kind == "ones":
        tensor.fill_(1.0)
        return
    generator = torch.Generator(device="cpu")
    generator.manual_seed(parameter_seed(seed, name))
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.normal_(mean=0.0, std=std, generator=generator)
    tensor.copy_(values)
