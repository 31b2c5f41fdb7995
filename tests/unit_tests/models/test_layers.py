"""Attention (causal, GQA), RoPE, norms and MLP against closed-form references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention, core_attention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norm import LayerNorm, RMSNorm
from megatron.core.transformer.rope import RotaryEmbedding, apply_rotary
from tests.unit_tests.models.model_configs import tiny_config, token_batch


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _repeat_kv_rows(rows: torch.Tensor, *, groups: int, repeats: int) -> torch.Tensor:
    """[groups * d, ...] -> [groups * repeats * d, ...], group g serving heads g*r .. g*r+r-1."""
    per_group = rows.view(groups, rows.shape[0] // groups, *rows.shape[1:])
    return per_group.repeat_interleave(repeats, dim=0).reshape(-1, *rows.shape[1:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = GPTModel(tiny_config(position_embedding_type="rope", num_query_groups=2)).eval()
    mha = GPTModel(tiny_config(position_embedding_type="rope", num_query_groups=4)).eval()
    mha_params = dict(mha.named_parameters())
    with torch.no_grad():
        for name, param in gqa.named_parameters():
            if "linear_qkv" not in name:
                mha_params[name].copy_(param)
                continue
            # GQA rows: [q 32 | k 16 | v 16]; MHA rows: [q 32 | k 32 | v 32].
            q, k, v = torch.split(param, [32, 16, 16], dim=0)
            k4 = _repeat_kv_rows(k, groups=2, repeats=2)
            v4 = _repeat_kv_rows(v, groups=2, repeats=2)
            mha_params[name].copy_(torch.cat([q, k4, v4], dim=0))
        ids = token_batch()
        gqa_logits, mha_logits = gqa(ids), mha(ids)
    torch.testing.assert_close(gqa_logits, mha_logits, atol=1e-6, rtol=0)
    assert gqa_logits.abs().max().item() > 0.05


def test_attention_matches_naive_causal_softmax_with_groups():
    config = tiny_config(num_query_groups=2, add_bias_linear=True)
    attention = SelfAttention(config, layer_number=1)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(_randn(*param.shape, seed=param.numel()) * 0.2)
    x = _randn(2, 6, 32, seed=3)
    with torch.no_grad():
        out = attention(x)
        qkv = attention.linear_qkv(x)
        q = qkv[..., :32].view(2, 6, 4, 8).transpose(1, 2)
        k = qkv[..., 32:48].view(2, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = qkv[..., 48:].view(2, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        context = (probs @ v).transpose(1, 2).reshape(2, 6, 32)
        expected = attention.linear_proj(context)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_rope_inverse_frequencies_and_partial_rotation():
    config = tiny_config(position_embedding_type="rope", rotary_base=500, rotary_percent=0.5)
    rope = RotaryEmbedding(config)
    # kv_channels 8 at 50% -> 4 rotary channels -> theta_i = 500^(-2i/4), i = 0, 1.
    torch.testing.assert_close(rope.inv_freq, torch.tensor([1.0, 500**-0.5]), atol=0, rtol=1e-6)
    x = _randn(1, 2, 5, 8, seed=4)
    cos, sin = rope(torch.arange(5).unsqueeze(0))
    assert cos.shape == (1, 1, 5, 4)
    rotated = apply_rotary(x, cos, sin)
    assert torch.equal(rotated[..., 4:], x[..., 4:])  # the non-rotary channels pass through
    assert (rotated[..., :4] - x[..., :4]).abs().max().item() > 0.1


def test_rope_matches_complex_number_reference():
    config = tiny_config(position_embedding_type="rope", rotary_base=10000)
    rope = RotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 5, 17, 300]])
    x = _randn(1, 3, 5, 8, seed=5)
    cos, sin = rope(positions)
    out = apply_rotary(x, cos, sin)
    # rotate_half pairs channel i with i + d/2: z_i = x_i + j x_{i+d/2}, z_i *= exp(j m theta_i).
    x64 = x.double()
    z = torch.complex(x64[..., :4], x64[..., 4:])
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angle = positions.double()[0].view(1, 1, 5, 1) * theta
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_rope_scores_depend_only_on_relative_position():
    config = tiny_config(position_embedding_type="rope")
    rope = RotaryEmbedding(config)
    q, k = _randn(1, 2, 6, 8, seed=6), _randn(1, 2, 6, 8, seed=7)
    base = torch.arange(6).unsqueeze(0)
    scores = []
    for offset in (0, 11, 250):
        cos, sin = rope(base + offset)
        scores.append(apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2))
    torch.testing.assert_close(scores[1], scores[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(scores[2], scores[0], atol=1e-4, rtol=0)
    # Without rotation scores would differ: rope really is applied.
    assert (scores[0] - q @ k.transpose(-1, -2)).abs().max().item() > 0.1


def test_rmsnorm_and_layernorm_match_closed_form():
    x = _randn(3, 16, seed=8) * 3 + 1
    weight, bias = _randn(16, seed=9), _randn(16, seed=10)
    rms = RMSNorm(16, eps=1e-5, dtype=torch.float32)
    layer = LayerNorm(16, eps=1e-5, dtype=torch.float32)
    with torch.no_grad():
        rms.weight.copy_(weight)
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
        x64 = x.double()
        expected_rms = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        centered = x64 - x64.mean(-1, keepdim=True)
        variance = (centered**2).mean(-1, keepdim=True)
        expected_ln = centered / torch.sqrt(variance + 1e-5) * weight.double() + bias.double()
        torch.testing.assert_close(rms(x).double(), expected_rms, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer(x).double(), expected_ln, atol=1e-5, rtol=0)
        # bf16 input: computed in fp32 and rounded once at the end.
        rms16 = RMSNorm(16, eps=1e-5, dtype=torch.bfloat16)
        rms16.weight.copy_(weight.bfloat16())
        x16 = x.bfloat16()
        fp32_result = x16.float() * torch.rsqrt(x16.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        expected16 = (fp32_result * weight.bfloat16().float()).bfloat16()
        assert torch.equal(rms16(x16), expected16)


def test_mlp_gelu_is_exact_erf_and_swiglu_is_gate_then_up():
    x = _randn(2, 3, 32, seed=11)
    gelu_mlp = MLP(tiny_config(ffn_hidden_size=24), layer_number=1)
    swiglu_mlp = MLP(tiny_config(ffn_hidden_size=24, swiglu=True), layer_number=1)
    assert swiglu_mlp.linear_fc1.out_features == 48
    with torch.no_grad():
        h = gelu_mlp.linear_fc1(x)
        erf_gelu = 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0)))
        torch.testing.assert_close(gelu_mlp(x), gelu_mlp.linear_fc2(erf_gelu), atol=1e-6, rtol=0)
        h = swiglu_mlp.linear_fc1(x)
        gate, up = h[..., :24], h[..., 24:]
        expected = swiglu_mlp.linear_fc2(gate * torch.sigmoid(gate) * up)
        torch.testing.assert_close(swiglu_mlp(x), expected, atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_cuda_bf16_native_gqa_matches_repeated_kv():
    q = _randn(2, 8, 64, 64, seed=12).cuda().bfloat16()
    k, v = (_randn(2, 2, 64, 64, seed=s).cuda().bfloat16() for s in (13, 14))
    grouped = core_attention(q, k, v, 0.0)
    repeated = core_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), 0.0)
    torch.testing.assert_close(grouped.float(), repeated.float(), atol=2e-2, rtol=0)


def test_rope_frequencies_survive_to_empty_and_dtype_casts():
    config = tiny_config(position_embedding_type="rope")
    expected = RotaryEmbedding(config).inv_freq.clone()
    with torch.device("meta"):
        model = GPTModel(config)
    model.to_empty(device="cpu")  # no init_buffers call: the move itself recomputes
    assert torch.equal(model.rotary_pos_emb.inv_freq, expected)
    model.to(torch.bfloat16)
    assert model.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary_pos_emb.inv_freq, expected)
