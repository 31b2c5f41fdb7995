"""Multi-token prediction losses and gradients against a plain-torch reference written here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mtp import MTPMetrics, mtp_config_problem, mtp_loss_name
from tests.unit_tests.models.model_configs import tiny_config, token_batch


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _shift(t: torch.Tensor, k: int) -> torch.Tensor:
    """Row-wise t[:, i + k], zero where i + k is past the end."""
    out = torch.zeros_like(t)
    out[:, : t.shape[1] - k] = t[:, k:]
    return out


def _reference(model: GPTModel, tokens, labels, mask):
    """(main per-token loss, [mtp loss per depth]) computed from the model's weights, its
    decoder and the MTP layers' transformer layers used as blocks."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    table = model.embedding.word_embeddings.weight
    cos_sin = model.rotary_pos_emb(positions)
    hidden = model.decoder(table[tokens], cos_sin)
    main = F.cross_entropy((hidden @ table.T).flatten(0, 1), labels.flatten(), reduction="none")
    losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        e = _rms(table[_shift(tokens, k)], layer.enorm.weight)
        joined = torch.cat((e, _rms(hidden, layer.hnorm.weight)), dim=-1) @ layer.eh_proj.weight.T
        hidden = _rms(layer.transformer_layer(joined, cos_sin), layer.final_layernorm.weight)
        ce = F.cross_entropy(
            (hidden @ table.T).flatten(0, 1), _shift(labels, k).flatten(), reduction="none"
        )
        mask_k = _shift(mask, k).flatten().float()
        losses.append((ce * mask_k).sum() / mask_k.sum())
    return main.view_as(labels), losses


def _model(depths: int, **overrides) -> GPTModel:
    config = tiny_config(
        position_embedding_type="rope",
        normalization="RMSNorm",
        mtp_num_layers=depths,
        mtp_loss_scaling_factor=0.3,
        **overrides,
    )
    return GPTModel(config, seed=3)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_losses_and_gradients_match_reference(depths: int):
    model = _model(depths)
    reference_model = copy.deepcopy(model)
    tokens = token_batch(seed=4)
    labels = _shift(tokens, 1)
    mask = torch.ones_like(tokens)
    mask[0, 3] = 0
    mask[:, -1] = 0
    main = model(tokens, labels=labels, loss_mask=mask)
    (main * mask).sum().div(mask.sum()).backward()
    report = model.mtp.metrics.report()

    ref_main, ref_losses = _reference(reference_model, tokens, labels, mask)
    objective = (ref_main * mask).sum() / mask.sum() + 0.3 / depths * torch.stack(ref_losses).sum()
    objective.backward()
    # The returned loss is the language-model loss only; MTP adds its gradient.
    torch.testing.assert_close(main, ref_main, atol=1e-6, rtol=1e-6)
    assert (
        list(report)
        == [mtp_loss_name(k) for k in range(1, depths + 1)]
        == [f"mtp_{k} loss" for k in range(1, depths + 1)]
    )
    for k, loss in enumerate(ref_losses, start=1):
        assert abs(report[f"mtp_{k} loss"] - loss.item()) < 1e-5
    for (name, got), (_, want) in zip(
        model.named_parameters(), reference_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_backward_scale_and_untied_head_share_the_output_layer():
    tokens = token_batch(seed=5)
    labels = _shift(tokens, 1)
    grads = []
    for scale in (1.0, 0.5):
        model = _model(1, untie_embeddings_and_output_weights=True)
        model.mtp.metrics.set_backward_scale(scale)
        # The main loss times 0: only the MTP loss (x 0.3 x backward scale) reaches the grads.
        model(tokens, labels=labels).sum().mul(0.0).backward()
        grads.append(model.output_layer.weight.grad.clone())
        assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    assert grads[0].abs().sum() > 0  # the MTP logits use the untied output layer
    torch.testing.assert_close(grads[1], 0.5 * grads[0], atol=1e-9, rtol=1e-6)


def test_mtp_metrics_average_over_forwards_and_reset():
    metrics = MTPMetrics(2)
    metrics.record([torch.tensor(1.0), torch.tensor(4.0)])
    metrics.record([torch.tensor(3.0), torch.tensor(2.0)])
    assert metrics.report() == {"mtp_1 loss": 2.0, "mtp_2 loss": 3.0}
    metrics.reset()
    assert metrics.report() == {}


def test_mtp_config_problems_name_the_flags():
    def config(**fields):
        return tiny_config(**fields)

    assert mtp_config_problem(config()) is None
    assert mtp_config_problem(config(mtp_num_layers=0)) is None
    assert "--mtp-num-layers -1" in mtp_config_problem(config(mtp_num_layers=-1))
    problem = mtp_config_problem(config(mtp_num_layers=1, mtp_loss_scaling_factor=-0.1))
    assert "--mtp-loss-scaling-factor -0.1" in problem
