"""Activation recompute (full and selective) reproduces loss and gradients bitwise."""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from tests.unit_tests.models.model_configs import tiny_config, token_batch


def _loss_and_grads(granularity, *, dropout: float, recompute_num_layers: int = 1):
    config = tiny_config(
        num_layers=3,
        position_embedding_type="rope",
        swiglu=True,
        num_query_groups=2,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        recompute_granularity=granularity,
        recompute_num_layers=recompute_num_layers,
    )
    model = GPTModel(config, seed=9).train()
    ids = token_batch(seed=12)
    torch.manual_seed(1234)  # the dropout stream
    loss = model(ids, labels=ids).mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("granularity,chunk", [("full", 1), ("full", 2), ("selective", 1)])
def test_recompute_gives_bitwise_equal_loss_and_grads(granularity, chunk, dropout):
    reference_loss, reference_grads = _loss_and_grads(None, dropout=dropout)
    loss, grads = _loss_and_grads(granularity, dropout=dropout, recompute_num_layers=chunk)
    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, reference_grads[name]), name
    if dropout > 0:
        # Dropout really was active: the loss differs from the dropout-free one.
        no_dropout_loss, _ = _loss_and_grads(None, dropout=0.0)
        assert abs(loss.item() - no_dropout_loss.item()) > 1e-4


def _saved_activation_elements(granularity) -> int:
    config = tiny_config(num_layers=2, recompute_granularity=granularity, recompute_num_layers=2)
    model = GPTModel(config).train()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(token_batch(seq=16), labels=token_batch(seq=16)).mean()
    return sum(saved)


def test_recompute_saves_fewer_activations():
    none, selective, full = (_saved_activation_elements(g) for g in (None, "selective", "full"))
    assert full < selective < none
