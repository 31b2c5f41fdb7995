"""muP against Megatron-LM core_v0.19.0's formulas (issue 36, acceptance 3): init std,
attention scale, embedding and output multipliers, per-group Adam lr and eps."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, build_torch_optimizer
from megatron.core.transformer import mup
from megatron.core.transformer.attention import core_attention
from megatron.core.transformer.init import _init_rule
from tests.unit_tests.models.model_configs import tiny_config, token_batch

STD = 0.02


def mup_config(**overrides):
    """hidden 128 over base 32 (width mult 4), 2 layers, 4 heads of 32 channels."""
    fields = dict(hidden_size=128, use_mup=True, mup_base_hidden_size=32, init_method_std=STD)
    fields.update(overrides)
    return tiny_config(**fields)


def test_width_mult_and_default_base():
    assert mup.width_mult(mup_config()) == 4.0
    assert mup.width_mult(mup_config(mup_base_hidden_size=None)) == 1.0
    assert mup.width_mult(tiny_config(hidden_size=128, mup_base_hidden_size=32)) == 1.0


@pytest.mark.parametrize(
    "name, std",
    [
        ("decoder.layers.0.self_attention.linear_qkv.weight", STD / 2),  # std / sqrt(4)
        ("decoder.layers.1.mlp.linear_fc1.weight", STD / 2),
        ("decoder.layers.0.self_attention.linear_proj.weight", STD / 2 / 2),  # / sqrt(2 L) too
        ("decoder.layers.1.mlp.linear_fc2.weight", STD / 2 / 2),
        ("embedding.word_embeddings.weight", STD),
        ("output_layer.weight", STD),
    ],
)
def test_init_std_follows_the_formulas(name, std):
    config = mup_config(untie_embeddings_and_output_weights=True)
    assert _init_rule(name, config) == ("normal", pytest.approx(std, rel=1e-12))
    standard = tiny_config(hidden_size=128, untie_embeddings_and_output_weights=True)
    residual = "linear_proj" in name or "linear_fc2" in name
    assert _init_rule(name, standard)[1] == (STD / math.sqrt(4) if residual else STD)
    weight = dict(GPTModel(config, seed=5).named_parameters())[name]
    assert weight.std().item() == pytest.approx(std, rel=0.03)


@pytest.mark.parametrize(
    "base_head_dim, power, scale",
    [(None, 1.0, 1 / 32), (8, 1.0, math.sqrt(8) / 32), (8, 0.5, math.sqrt(8) / math.sqrt(32))],
)
def test_attention_softmax_scale(base_head_dim, power, scale):
    config = mup_config(mup_base_head_dim=base_head_dim, mup_attn_scale_power=power)
    assert config.kv_channels == 32
    model = GPTModel(config, seed=1)
    assert model.decoder.layers[0].self_attention.softmax_scale == pytest.approx(scale)
    assert GPTModel(tiny_config(), seed=1).decoder.layers[0].self_attention.softmax_scale is None
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 32, generator=generator) for _ in range(3))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v
    torch.testing.assert_close(core_attention(q, k, v, 0.0, scale), expected)


@pytest.mark.parametrize("output_mult, expected", [(1.0, 0.25), (3.0, 3.0)])
def test_logits_are_scaled_by_the_output_mult(output_mult, expected):
    model = GPTModel(mup_config(mup_output_mult=output_mult), seed=2).eval()
    assert model.mup_output_mult == expected
    tokens = token_batch()
    with torch.no_grad():
        scaled = model(tokens)
        model.mup_output_mult = 1.0
        plain = model(tokens)
    torch.testing.assert_close(scaled, plain * expected, rtol=0, atol=0)


def test_embedding_output_is_scaled_by_the_embedding_mult():
    config = mup_config(mup_embedding_mult=2.5, position_embedding_type="rope")
    model = GPTModel(config, seed=3).eval()
    tokens = token_batch()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = model.embedding(tokens, positions)
    torch.testing.assert_close(out, model.embedding.word_embeddings.weight[tokens] * 2.5)
    assert GPTModel(tiny_config(), seed=3).embedding.mup_embedding_mult == 1.0


def _groups_by_name(model, config):
    named = list(model.named_parameters())
    optimizer = build_torch_optimizer(named, config=config)
    by_id = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {name: by_id[id(p)] for name, p in named}, optimizer


@pytest.mark.parametrize("decoupled_lr", [None, 5e-4])
def test_adam_hidden_matrices_get_lr_and_eps_over_width_mult(decoupled_lr):
    model = GPTModel(mup_config(untie_embeddings_and_output_weights=True), seed=4)
    config = OptimizerConfig(
        lr=1e-3, min_lr=1e-4, adam_eps=1e-8, mup_width_mult=4.0, decoupled_lr=decoupled_lr
    )
    groups, optimizer = _groups_by_name(model, config)
    assert "max_lr" not in optimizer.param_groups[0]  # the logged lr stays --lr's
    for name, group in groups.items():
        param = dict(model.named_parameters())[name]
        embedding_class = name.startswith("embedding.") or name == "output_layer.weight"
        if param.ndim >= 2 and not embedding_class:
            assert (group["max_lr"], group["min_lr"]) == (pytest.approx(2.5e-4), 2.5e-5), name
            assert group["eps"] == pytest.approx(2.5e-9), name
            continue
        assert group["eps"] == 1e-8, name
        if decoupled_lr is not None and name in (
            "embedding.word_embeddings.weight",
            "output_layer.weight",
        ):
            assert (group["max_lr"], group["min_lr"]) == (5e-4, 1e-4), name
        else:
            assert "max_lr" not in group, name  # the base schedule (--lr, --min-lr)


def test_sgd_scales_vector_like_lr_by_width_mult():
    model = GPTModel(mup_config(), seed=4)
    config = OptimizerConfig(optimizer="sgd", lr=1e-3, min_lr=0.0, mup_width_mult=4.0)
    groups, _ = _groups_by_name(model, config)
    assert groups["decoder.final_norm.weight"]["max_lr"] == pytest.approx(4e-3)
    assert groups["embedding.word_embeddings.weight"]["max_lr"] == pytest.approx(4e-3)
    assert "max_lr" not in groups["decoder.layers.0.mlp.linear_fc1.weight"]


def test_width_mult_one_keeps_the_standard_groups():
    model = GPTModel(tiny_config(), seed=4)
    plain, _ = _groups_by_name(model, OptimizerConfig(lr=1e-3))
    one, _ = _groups_by_name(model, OptimizerConfig(lr=1e-3, mup_width_mult=1.0))
    assert all("max_lr" not in g and g["eps"] == 1e-8 for g in [*plain.values(), *one.values()])
