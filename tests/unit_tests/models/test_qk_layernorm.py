"""--qk-layernorm on standard attention against a plain-torch reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention
from tests.unit_tests.models.model_configs import tiny_config, token_batch


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _norm(x: torch.Tensor, weight: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    x = x.double()
    if kind == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate channel i with i + d/2 by angle pos * base^(-2i/d) ([B, H, S, d])."""
    d, seq = x.shape[-1], x.shape[-2]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    scores = q @ k.transpose(-1, -2) * scale
    seq = q.shape[-2]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _reference(attn: SelfAttention, x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    batch, seq, _ = x.shape
    heads, dim = attn.num_heads, attn.head_dim
    qkv = x.double() @ attn.linear_qkv.weight.double().T + attn.linear_qkv.bias.double()
    q, k, v = (
        part.reshape(batch, seq, heads, dim).transpose(1, 2) for part in qkv.chunk(3, dim=-1)
    )
    q = _rope(_norm(q, attn.q_layernorm.weight, kind, eps), 10000.0)
    k = _rope(_norm(k, attn.k_layernorm.weight, kind, eps), 10000.0)
    context = _causal_attention(q, k, v.double(), 1 / math.sqrt(dim))
    out = context.transpose(1, 2).reshape(batch, seq, heads * dim)
    return out @ attn.linear_proj.weight.double().T + attn.linear_proj.bias.double()


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_qk_layernorm_matches_per_head_norm_then_rope_reference(kind: str):
    config = tiny_config(position_embedding_type="rope", normalization=kind, qk_layernorm=True)
    model = GPTModel(config).eval()
    attn = model.decoder.layers[0].self_attention
    assert tuple(attn.q_layernorm.weight.shape) == (8,)  # one norm over kv_channels
    with torch.no_grad():
        attn.q_layernorm.weight.copy_(1 + 0.5 * _randn(8, seed=3))
        attn.k_layernorm.weight.copy_(1 + 0.5 * _randn(8, seed=4))
        attn.linear_qkv.bias.copy_(0.1 * _randn(96, seed=5))
    x = _randn(2, 6, 32, seed=6)
    cos_sin = model.rotary_pos_emb(torch.arange(6).expand(2, 6))
    out = attn(x, cos_sin)
    expected = _reference(attn, x, kind, config.layernorm_epsilon)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_qk_layernorm_off_builds_no_norm_and_changes_nothing():
    rms = dict(position_embedding_type="rope", normalization="RMSNorm")
    plain = GPTModel(tiny_config(**rms)).eval()
    normed = GPTModel(tiny_config(**rms, qk_layernorm=True)).eval()
    assert plain.decoder.layers[0].self_attention.q_layernorm is None
    names = set(dict(normed.named_parameters())) - set(dict(plain.named_parameters()))
    assert names == {
        f"decoder.layers.{i}.self_attention.{n}_layernorm.weight" for i in (0, 1) for n in "qk"
    }
    tokens = token_batch()
    # Norm weights start at 1, so the normed model differs from the plain one by the norm only:
    # finite logits, unequal to the plain model's.
    logits_plain, logits_normed = plain(tokens), normed(tokens)
    assert torch.isfinite(logits_normed).all()
    assert not torch.allclose(logits_plain, logits_normed, atol=1e-3)
    assert normed.decoder.layers[1].self_attention.k_layernorm.weight.sum().item() == 8.0
