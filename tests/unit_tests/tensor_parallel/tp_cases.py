"""Rank functions for the tensor-parallel tests: each builds a TP = 1 module and its
tensor-parallel twin from the same full tensors, runs both on the same batch and returns the
largest differences of outputs and gradients (the twin's gradients compared with the shard of
the full gradient that the rank holds)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import (
    TensorParallel,
    all_reduce_sequence_parallel_grads,
    tensor_parallel_shards,
)
from megatron.core.tensor_parallel.layers import ColumnSplit
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

BATCH, SEQ = 2, 8


def tiny_config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=48,
        vocab_size=64,
        max_sequence_length=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _copy_full_into_twin(full: nn.Module, twin: nn.Module) -> None:
    owners = tensor_parallel_shards(twin)
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in twin.named_parameters():
            value = full_params[name]
            owner = owners.get(name)
            if owner is not None:
                value = owner.shard_of_full(name.rsplit(".", 1)[-1], value)
            param.copy_(value)


def _grad_error(full: nn.Module, twin: nn.Module) -> float:
    owners = tensor_parallel_shards(twin)
    full_params = dict(full.named_parameters())
    worst = 0.0
    for name, param in twin.named_parameters():
        expected = full_params[name].grad
        owner = owners.get(name)
        if owner is not None:
            expected = owner.shard_of_full(name.rsplit(".", 1)[-1], expected)
        assert param.grad is not None, name
        worst = max(worst, (param.grad - expected).abs().max().item())
    return worst


def _run_block(kind: str, tp: TensorParallel, config: TransformerConfig) -> dict[str, float]:
    """MLP or attention (rope, GQA): output and grads of the TP twin against TP = 1."""
    torch.manual_seed(1)
    build = MLP if kind == "mlp" else SelfAttention
    full = build(config, layer_number=1)
    for param in full.parameters():
        nn.init.normal_(param, std=0.05)
    twin = build(config, layer_number=1, tensor_parallel=tp)
    _copy_full_into_twin(full, twin)
    x = torch.randn(BATCH, SEQ, config.hidden_size)
    grad_out = torch.randn(BATCH, SEQ, config.hidden_size) / (BATCH * SEQ)  # a mean loss
    args = ()
    if kind == "attention":
        rope = RotaryEmbedding(config)
        args = (rope(torch.arange(SEQ).expand(BATCH, SEQ)),)
    x_full = x.clone().requires_grad_()
    full(x_full, *args).backward(grad_out)
    x_twin = x.clone().requires_grad_()
    inp = x_twin
    if tp.sequence_parallel:
        inp = scatter_to_sequence_parallel_region(x_twin, tp.group)
    saved_shapes, hidden, inside = [], config.hidden_size, []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside and not isinstance(t, nn.Parameter):  # the column-parallel Linears' activations
            saved_shapes.append(tuple(t.shape))
        return t

    for module in twin.modules():
        if isinstance(module, ColumnSplit):
            module.register_forward_pre_hook(lambda *_: inside.append(True))
            module.register_forward_hook(lambda *_: inside.clear())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = twin(inp, *args)
    if tp.sequence_parallel:
        assert out.shape[1] == SEQ // tp.size
        out = gather_from_sequence_parallel_region(out, tp.group, grad_is_partial=False)
    out.backward(grad_out)
    if tp.sequence_parallel:
        all_reduce_sequence_parallel_grads(twin, tp.group)  # the row-parallel bias
    expected_out = full(x, *args).detach()
    return {
        "out": (out.detach() - expected_out).abs().max().item(),
        "input_grad": (x_twin.grad - x_full.grad).abs().max().item(),
        "grads": _grad_error(full, twin),
        # Column-parallel inputs kept at the gathered [B, S, D] (Megatron-LM keeps the shard).
        "gathered_saved": float(
            sum(s in [(BATCH, SEQ, hidden), (BATCH * SEQ, hidden)] for s in saved_shapes)
        ),
    }


def _run_gpt(tp: TensorParallel, config: TransformerConfig) -> dict[str, float]:
    """GPTModel at TP = 1 and its TP twin built from the same seed (reset_parameters draws full
    tensors and keeps shards): per-token losses and every gradient."""
    full = GPTModel(config, seed=7)
    twin = GPTModel(config, seed=7, tensor_parallel=tp)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    init_error = 0.0
    owners = tensor_parallel_shards(twin)
    full_params = dict(full.named_parameters())
    for name, param in twin.named_parameters():
        expected = full_params[name].detach()
        if name in owners:
            expected = owners[name].shard_of_full(name.rsplit(".", 1)[-1], expected)
        init_error = max(init_error, (param.detach() - expected).abs().max().item())
    full_loss = full(ids, labels=labels)
    full_loss.mean().backward()
    twin_loss = twin(ids, labels=labels)
    twin_loss.mean().backward()
    if tp.sequence_parallel:
        all_reduce_sequence_parallel_grads(twin, tp.group)
    return {
        "init": init_error,
        "loss": (twin_loss.detach() - full_loss.detach()).abs().max().item(),
        "grads": _grad_error(full, twin),
    }


GPT_VARIANTS = {
    "swiglu_rope_rmsnorm_untied": dict(
        swiglu=True,
        position_embedding_type="rope",
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
    ),
    "gelu_learned_layernorm_tied": dict(),
}


def all_cases(rank: int, world_size: int) -> dict[str, float]:
    """Every case at TP = world size, with and without sequence parallelism."""
    torch.set_default_dtype(torch.float32)
    results = {}
    for sequence_parallel in (False, True):
        tp = TensorParallel(dist.group.WORLD, sequence_parallel=sequence_parallel)
        tag = "sp" if sequence_parallel else "tp"
        for kind, overrides in (
            ("mlp", dict(swiglu=True)),
            ("mlp", dict()),
            ("attention", dict(position_embedding_type="rope")),
        ):
            name = f"{tag}/{kind}/{'swiglu' if overrides.get('swiglu') else 'plain'}"
            for key, value in _run_block(kind, tp, tiny_config(**overrides)).items():
                results[f"{name}/{key}"] = value
        for variant, overrides in GPT_VARIANTS.items():
            for key, value in _run_gpt(tp, tiny_config(**overrides)).items():
                results[f"{tag}/gpt/{variant}/{key}"] = value
    return results
