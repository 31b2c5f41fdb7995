"""GPTModel shapes, parameter counts, causality, loss, bf16, structure and input errors."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import (
    GPTModel,
    TransformerLayer,
    count_parameters,
    count_parameters_from_config,
)
from tests.unit_tests.models.model_configs import SEQ, VOCAB, tiny_config, token_batch


def closed_form_parameter_count(
    *,
    layers,
    hidden,
    heads,
    groups,
    head_dim,
    ffn,
    vocab,
    max_seq,
    learned,
    layernorm,
    swiglu,
    bias,
    untied,
):
    norm = 2 * hidden if layernorm else hidden
    qkv = hidden * (heads + 2 * groups) * head_dim + bias * (heads + 2 * groups) * head_dim
    proj = heads * head_dim * hidden + bias * hidden
    fc1_out = ffn * (2 if swiglu else 1)
    mlp = hidden * fc1_out + bias * fc1_out + ffn * hidden + bias * hidden
    per_layer = 2 * norm + qkv + proj + mlp
    embeddings = vocab * hidden + (max_seq * hidden if learned else 0)
    return embeddings + layers * per_layer + norm + (vocab * hidden if untied else 0)


OPTIONS = list(
    itertools.product(
        ["rope", "learned_absolute"], ["LayerNorm", "RMSNorm"], [False, True], [4, 2], [False, True]
    )
)


@pytest.mark.parametrize("position,norm,swiglu,groups,untied", OPTIONS)
def test_shapes_and_parameter_count_for_every_option(position, norm, swiglu, groups, untied):
    bias = not swiglu  # covers both bias settings across the grid
    config = tiny_config(
        position_embedding_type=position,
        normalization=norm,
        swiglu=swiglu,
        num_query_groups=groups,
        untie_embeddings_and_output_weights=untied,
        add_bias_linear=bias,
        ffn_hidden_size=48,
    )
    model = GPTModel(config)
    ids = token_batch()
    assert model(ids).shape == (2, SEQ, VOCAB)
    loss = model(ids, labels=ids)
    assert loss.shape == (2, SEQ) and loss.dtype == torch.float32
    expected = closed_form_parameter_count(
        layers=2,
        hidden=32,
        heads=4,
        groups=groups,
        head_dim=8,
        ffn=48,
        vocab=VOCAB,
        max_seq=16,
        learned=position == "learned_absolute",
        layernorm=norm == "LayerNorm",
        swiglu=swiglu,
        bias=int(bias),
        untied=untied,
    )
    assert count_parameters(model) == expected
    assert count_parameters_from_config(config) == expected
    assert (model.output_layer is None) == (not untied)


def test_bias_flag_controls_every_linear_bias():
    with_bias = GPTModel(tiny_config(add_bias_linear=True))
    without_bias = GPTModel(tiny_config(add_bias_linear=False))
    linear_biases = [n for n, _ in with_bias.named_parameters() if "linear_" in n and "bias" in n]
    # 4 Linears per layer x 2 layers.
    assert len(linear_biases) == 8
    assert not [n for n, _ in without_bias.named_parameters() if "linear_" in n and "bias" in n]


def test_structure_the_fsdp_engine_relies_on():
    model = GPTModel(tiny_config())
    assert len(model.decoder.layers) == 2
    assert all(isinstance(layer, TransformerLayer) for layer in model.decoder.layers)
    layer_params = sum(p.numel() for p in model.decoder.layers.parameters())
    final_norm = sum(p.numel() for p in model.decoder.final_norm.parameters())
    embedding = sum(p.numel() for p in model.embedding.parameters())
    assert layer_params + final_norm + embedding == count_parameters(model)
    # Tied head: the logits GEMM reads the embedding table itself.
    assert model.output_weight() is model.embedding.word_embeddings.weight


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
def test_changing_a_token_never_changes_earlier_logits(position):
    model = GPTModel(tiny_config(position_embedding_type=position, num_query_groups=2)).eval()
    ids = token_batch(batch=1, seq=12)
    changed_at = 7
    other = ids.clone()
    other[0, changed_at] = (ids[0, changed_at] + 5) % VOCAB
    with torch.no_grad():
        logits, other_logits = model(ids), model(other)
    assert (logits[:, :changed_at] - other_logits[:, :changed_at]).abs().max().item() == 0.0
    # And the change does reach position t itself.
    assert (logits[:, changed_at] - other_logits[:, changed_at]).abs().max().item() > 1e-4


def test_loss_equals_cross_entropy_of_logits():
    model = GPTModel(tiny_config(position_embedding_type="rope")).eval()
    ids, labels = token_batch(seed=2), token_batch(seed=3)
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids, labels=labels)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.view(2, SEQ), rtol=0, atol=0)
    # Untrained model: logits are small (std-0.02 head over a unit-RMS hidden state), so the
    # loss sits just above ln(V) = 4.159.
    assert 0.0 < loss.mean().item() - torch.log(torch.tensor(float(VOCAB))).item() < 0.15


def test_bf16_loss_within_two_percent_of_fp32_on_same_weights():
    fp32_model = GPTModel(tiny_config(position_embedding_type="rope", swiglu=True), seed=5).eval()
    bf16_config = tiny_config(
        position_embedding_type="rope", swiglu=True, params_dtype=torch.bfloat16
    )
    bf16_model = GPTModel(bf16_config, seed=5).eval()
    for (name, p32), (_, p16) in zip(fp32_model.named_parameters(), bf16_model.named_parameters()):
        assert p16.dtype == torch.bfloat16, name
        # Same seed: the bf16 weights are the fp32 draw rounded to bf16.
        assert torch.equal(p16, p32.to(torch.bfloat16)), name
    ids = token_batch(seed=4)
    with torch.no_grad():
        loss32 = fp32_model(ids, labels=ids)
        loss16 = bf16_model(ids, labels=ids)
        assert bf16_model(ids).dtype == torch.bfloat16
    assert loss16.dtype == torch.float32
    relative = abs(loss16.mean().item() - loss32.mean().item()) / loss32.mean().item()
    assert relative < 0.02


def test_explicit_position_ids_shift_rope_but_not_relative_attention():
    model = GPTModel(tiny_config(position_embedding_type="rope")).eval()
    ids = token_batch(batch=1)
    shifted = torch.arange(SEQ).unsqueeze(0) + 3
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=shifted), model(ids), atol=2e-5, rtol=0)
    learned = GPTModel(tiny_config()).eval()
    with torch.no_grad():
        diff = (learned(ids, position_ids=shifted) - learned(ids)).abs().max().item()
    assert diff > 1e-3  # learned absolute positions do see the shift


def test_bad_inputs_and_configs_raise_with_fix():
    model = GPTModel(tiny_config())
    with pytest.raises(ValueError, match="exceeds max_sequence_length=16"):
        model(token_batch(seq=17))
    with pytest.raises(ValueError, match=r"must be \[batch, seq\]"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        model(token_batch(), labels=token_batch(seq=4))
    with pytest.raises(ValueError, match="multiple of num_query_groups=3"):
        GPTModel(tiny_config(num_query_groups=3))
    with pytest.raises(ValueError, match="rotary_percent"):
        GPTModel(tiny_config(position_embedding_type="rope", rotary_percent=0.1))
    with pytest.raises(ValueError, match="recompute_granularity"):
        GPTModel(tiny_config(recompute_granularity="partial"))
