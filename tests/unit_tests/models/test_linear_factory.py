"""build_linear: plain nn.Linear without FP8, Fp8Linear only for the layers FP8 covers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron.core.transformer.linear as linear_factory
from megatron.core.fp8.config import Fp8Config
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.linear import build_linear
from tests.unit_tests.models.model_configs import tiny_config, token_batch


class RecordingFp8Linear(nn.Linear):
    """Stand-in with Fp8Linear's constructor; records what the factory passed."""

    built: list[dict] = []

    def __init__(self, in_features, out_features, *, bias, fp8_config, dtype):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.fp8_config = fp8_config  # read by linear_of_activation, as Fp8Linear's
        RecordingFp8Linear.built.append(
            dict(shape=(out_features, in_features), bias=bias, fp8_config=fp8_config, dtype=dtype)
        )

    def forward(self, x, activation_input=None, activation=None):
        # Fp8Linear's signature: fc2 is called with its activation's input by default
        # (wgrad_input_from_activation); the stand-in multiplies as nn.Linear.
        return super().forward(x)


def test_without_fp8_every_linear_is_plain_in_params_dtype():
    config = tiny_config(params_dtype=torch.bfloat16)
    linear = build_linear(32, 96, bias=False, config=config, layer_number=1)
    assert type(linear) is nn.Linear
    assert linear.weight.dtype == torch.bfloat16 and linear.weight.shape == (96, 32)
    assert linear.bias is None
    with pytest.raises(ValueError, match="outside 1..2"):
        build_linear(32, 96, bias=False, config=config, layer_number=0)


def test_fp8_only_in_covered_layers_never_embedding_or_head(monkeypatch):
    monkeypatch.setattr(linear_factory, "Fp8Linear", RecordingFp8Linear)
    RecordingFp8Linear.built = []
    fp8_config = Fp8Config(num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    config = tiny_config(num_layers=4, fp8=fp8_config, untie_embeddings_and_output_weights=True)
    model = GPTModel(config)
    kinds = []
    for layer in model.decoder.layers:
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        kinds.append([type(m) is RecordingFp8Linear for m in linears])
    # Layers 1 and 4 stay high precision; 2 and 3 have all 4 Linears in FP8.
    assert kinds == [[False] * 4, [True] * 4, [True] * 4, [False] * 4]
    assert type(model.output_layer) is nn.Linear
    assert len(RecordingFp8Linear.built) == 8
    assert RecordingFp8Linear.built[0] == dict(
        shape=(96, 32), bias=True, fp8_config=fp8_config, dtype=torch.float32
    )
    assert model(token_batch()).shape == (2, 8, 64)
