"""FLOPs and parameter-count helpers against hand counts and a measured GEMM count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.models.gpt import GPTModel, count_parameters, count_parameters_from_config
from megatron.core.models.gpt.flops import layer_parameters, num_floating_point_operations
from tests.unit_tests.models.model_configs import tiny_config, token_batch

# 2 layers, hidden 32, 4 heads of 8, 2 query groups, SwiGLU ffn 48, no biases, RMSNorm, V 64.
HAND_CONFIG = dict(
    num_query_groups=2,
    ffn_hidden_size=48,
    swiglu=True,
    add_bias_linear=False,
    normalization="RMSNorm",
    position_embedding_type="rope",
)


def test_flops_match_hand_count():
    config = tiny_config(**HAND_CONFIG)
    # Per layer: norms 2*32, qkv 32*(4+2+2)*8, proj 32*32, fc1 32*96, fc2 48*32.
    assert layer_parameters(config) == 64 + 2048 + 1024 + 3072 + 1536 == 7744
    # Params a token multiplies by: 2 layers + final norm 32 + head 64*32.
    matmul_params = 2 * 7744 + 32 + 2048
    # Per token: 6 * 17568 + 6 * 2 layers * 32 * seq 8 = 105408 + 3072 = 108480; 24 tokens.
    expected = 24 * (6 * matmul_params + 6 * 2 * 32 * 8)
    assert expected == 2_603_520
    assert num_floating_point_operations(config, batch_size=3, seq_length=8) == 2_603_520.0
    # Tied: parameters are embedding 2048 + 2 * 7744 + final norm 32.
    assert count_parameters_from_config(config) == 17_568


def _measured_gemm_flops(config) -> int:
    """The mm/addmm FLOPs of one forward + backward of the model on a 3 x 8 batch."""
    model = GPTModel(config)
    ids = token_batch(batch=3)
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(counts.get(op, 0) for op in (torch.ops.aten.mm, torch.ops.aten.addmm))


def test_gemm_flops_equal_measured_mm_count():
    config = tiny_config(**HAND_CONFIG)
    measured_mm = _measured_gemm_flops(config)
    # The formula minus its attention term and the (elementwise) norm parameters it includes.
    norm_params = 2 * 2 * 32 + 32
    attention = 24 * 6 * 2 * 32 * 8
    predicted = num_floating_point_operations(config, batch_size=3, seq_length=8)
    assert measured_mm == predicted - attention - 24 * 6 * norm_params == 2_506_752


# HAND_CONFIG with layer 2 an MoE layer: 4 experts of FFN 48, top-2, a shared expert of 40
# with its gate.
MOE_CONFIG = dict(
    HAND_CONFIG,
    num_moe_experts=4,
    moe_ffn_hidden_size=48,
    moe_layer_freq=[0, 1],
    moe_router_topk=2,
    moe_shared_expert_intermediate_size=40,
    moe_shared_expert_gate=True,
)


def test_moe_parameters_and_flops_match_hand_count():
    config = tiny_config(**MOE_CONFIG)
    # MoE layer: norms 64, qkv 2048, proj 1024; router 4*32; each expert 32*96 + 48*32 = 4608;
    # shared expert 32*80 + 40*32 = 3840; its gate 32.
    assert layer_parameters(config, moe_experts=4) == 3136 + 128 + 4 * 4608 + 3840 + 32 == 25568
    # Tied: embedding 2048 + dense layer 7744 + MoE layer 25568 + final norm 32.
    assert count_parameters_from_config(config) == 35_392
    assert sum(p.numel() for p in GPTModel(config).parameters()) == 35_392
    # A token multiplies by the dense layer, the MoE layer with its top-2 experts, the final
    # norm and the head: 7744 + (3136 + 128 + 2 * 4608 + 3840 + 32) + 32 + 2048.
    matmul_params = 7744 + 16352 + 32 + 2048
    expected = 24 * (6 * matmul_params + 6 * 2 * 32 * 8)
    assert num_floating_point_operations(config, batch_size=3, seq_length=8) == expected


def test_moe_gemm_flops_equal_measured_mm_count():
    """Dropless top-2 routing: the experts' GEMMs see each token twice, as the formula says."""
    config = tiny_config(**MOE_CONFIG)
    measured = _measured_gemm_flops(config)
    norm_params = 2 * 2 * 32 + 32
    attention = 24 * 6 * 2 * 32 * 8
    predicted = num_floating_point_operations(config, batch_size=3, seq_length=8)
    assert measured == predicted - attention - 24 * 6 * norm_params


MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4)
MLA.update(v_head_dim=8, num_query_groups=None)  # MLA has no key/value groups


@pytest.mark.parametrize(
    "overrides",
    [
        dict(HAND_CONFIG, qk_layernorm=True),
        dict(HAND_CONFIG, qk_layernorm=True, normalization="LayerNorm", add_bias_linear=True),
        dict(HAND_CONFIG, **MLA),
        dict(HAND_CONFIG, **MLA, q_lora_rank=24, qk_layernorm=True),
        dict(HAND_CONFIG, **MLA, q_lora_rank=24, qk_layernorm=True, normalization="LayerNorm"),
        dict(HAND_CONFIG, mtp_num_layers=2),
        dict(MOE_CONFIG, mtp_num_layers=1, untie_embeddings_and_output_weights=True),
    ],
    ids=[
        "qk-norm",
        "qk-norm-layernorm-bias",
        "mla",
        "mla-q-lora",
        "mla-layernorm",
        "mtp-2",
        "moe-mtp",
    ],
)
def test_parameter_count_from_config_equals_the_model(overrides):
    config = tiny_config(**overrides)
    assert count_parameters_from_config(config) == count_parameters(GPTModel(config))


def test_mla_and_mtp_gemm_flops_equal_measured_mm_count():
    """Latent projections, QK^T over (qk + pos) and PV over v dims, one MTP depth (its module
    and the head again): the formula's GEMM part equals the measured mm count."""
    config = tiny_config(**dict(HAND_CONFIG, **MLA), q_lora_rank=24, mtp_num_layers=1)
    measured = _measured_gemm_flops(config)
    # Elementwise norms the formula includes: 2 per layer, final, 3 per MTP depth + its layer's 2.
    norm_params = 32 * (2 * 2 + 1 + 3 + 2)
    attention = 24 * 3 * 3 * 4 * (8 + 4 + 8) * 8  # (2 layers + 1 depth) x 4 heads x 20 x S 8
    predicted = num_floating_point_operations(config, batch_size=3, seq_length=8)
    assert measured == predicted - attention - 24 * 6 * norm_params
