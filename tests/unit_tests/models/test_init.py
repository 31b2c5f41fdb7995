"""Deterministic init: seeds, meta construction, per-parameter independence, stds."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.init import init_parameter_
from tests.unit_tests.models.model_configs import tiny_config, token_batch


def test_same_seed_gives_bitwise_same_parameters_and_other_seed_differs():
    config = tiny_config(position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    first, second = GPTModel(config, seed=3), GPTModel(config, seed=3)
    other = GPTModel(config, seed=4)
    for (name, a), (_, b), (_, c) in zip(
        first.named_parameters(), second.named_parameters(), other.named_parameters()
    ):
        assert torch.equal(a, b), name
        if name.endswith("weight") and "norm" not in name:
            assert not torch.equal(a, c), name
    second.reset_parameters(4)
    assert all(torch.equal(a, c) for a, c in zip(second.parameters(), other.parameters()))


def test_meta_model_materialized_equals_eager_model():
    config = tiny_config(position_embedding_type="rope", swiglu=True)
    eager = GPTModel(config, seed=7).eval()
    with torch.device("meta"):
        meta = GPTModel(config, seed=7)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.rotary_pos_emb.inv_freq.is_meta
    meta.to_empty(device="cpu")
    meta.reset_parameters(7)
    meta.init_buffers("cpu")
    meta.eval()
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(meta(ids), eager(ids))


def test_one_parameter_materialized_alone_matches_full_model():
    eager = GPTModel(tiny_config(), seed=11)
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    expected = dict(eager.named_parameters())[name]
    alone = torch.empty(expected.shape)
    init_parameter_(alone, name=name, config=tiny_config(), seed=11)
    assert torch.equal(alone, expected)
    # Wrapper prefixes do not change the value; a bf16 target gets the fp32 draw rounded.
    wrapped = torch.empty(expected.shape, dtype=torch.bfloat16)
    init_parameter_(wrapped, name="module._orig_mod." + name, config=tiny_config(), seed=11)
    assert torch.equal(wrapped, expected.to(torch.bfloat16))
    # Other parameters existing or not (more layers, untied head) does not move this one.
    bigger = GPTModel(tiny_config(num_layers=3, untie_embeddings_and_output_weights=True), seed=11)
    for shared in (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "embedding.word_embeddings.weight",
    ):
        assert torch.equal(
            dict(bigger.named_parameters())[shared], dict(eager.named_parameters())[shared]
        )


def test_norms_ones_biases_zeros():
    model = GPTModel(tiny_config(add_bias_linear=True), seed=2)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if "layernorm" in name or "final_norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.equal(param, torch.full_like(param, expected)), name
        elif name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
    assert len(params) == 2 + 2 * 12 + 2  # word + position tables, 12 per layer, final norm


@pytest.mark.parametrize(
    "name,scale",
    [
        ("decoder.layers.0.mlp.linear_fc1.weight", 1.0),
        ("embedding.word_embeddings.weight", 1.0),
        ("decoder.layers.3.self_attention.linear_proj.weight", 1.0 / math.sqrt(2 * 8)),
        ("decoder.layers.5.mlp.linear_fc2.weight", 1.0 / math.sqrt(2 * 8)),
    ],
)
def test_weight_std_within_two_percent(name, scale):
    config = tiny_config(num_layers=8, init_method_std=0.03)
    weight = torch.empty(512, 512)
    init_parameter_(weight, name=name, config=config, seed=0)
    assert abs(weight.std().item() / (0.03 * scale) - 1.0) < 0.02
    assert abs(weight.mean().item()) < 0.03 * scale * 0.01


def test_unknown_parameter_name_raises_with_fix():
    with pytest.raises(ValueError, match="is not a GPTModel parameter name"):
        init_parameter_(torch.empty(2), name="encoder.weight", config=tiny_config(), seed=0)
    with pytest.raises(ValueError, match="no init rule"):
        init_parameter_(
            torch.empty(2), name="decoder.layers.0.gate.weight", config=tiny_config(), seed=0
        )
