"""The MoE layer against a loop-over-tokens reference (forward and grads), the grouped GEMM
against per-expert matmuls, and a tiny MoE GPT that trains on CPU with the aux loss in its
grads."""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe import routing
from megatron.core.transformer.moe.experts import grouped_gemm
from megatron.core.transformer.moe.metrics import MoEMetrics
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.models.model_configs import tiny_config, token_batch
from tests.unit_tests.models.moe.moe_helpers import (
    EXPERTS,
    fill_parameters,
    moe_config,
    reference_moe,
)


def test_grouped_gemm_equals_per_expert_matmuls():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, 5, generator=generator)
    weight = torch.randn(3, 4, 5, generator=generator)
    counts = [2, 0, 5]
    out = grouped_gemm(tokens, weight, counts)
    expected = torch.cat([tokens[:2] @ weight[0].t(), tokens[2:] @ weight[2].t()])
    assert torch.equal(out, expected)


def test_permute_unpermute_round_trip():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, generator=generator)
    probs, routing_map = routing.topk_routing(torch.randn(5, 4, generator=generator), topk=2)
    permuted, permuted_probs, token_indices, counts = permute(hidden, probs, routing_map)
    assert counts.tolist() == routing_map.sum(dim=0).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    assert torch.equal(permuted, hidden[token_indices])
    assert torch.equal(permuted_probs, probs[token_indices, expert_of_row])
    combined = unpermute(permuted, permuted_probs, token_indices, num_tokens=5)
    torch.testing.assert_close(combined, hidden * probs.sum(dim=1, keepdim=True))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_dropless_permute_at_a_static_count_equals_the_nonzero_one(score: str):
    """Dropless top-k (every token chose exactly k experts): the permutation found at the static
    count T x k (what a compiled graph holds) is bitwise the one `nonzero` finds, ties of the
    router's scores included (equal logits)."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 8, generator=generator)
    logits[::7] = 0.25  # whole rows of ties
    hidden = torch.randn(64, 3, generator=generator)
    probs, routing_map = routing.topk_routing(logits, topk=3, score_function=score)
    static = permute(hidden, probs, routing_map, per_token=3)
    found = permute(hidden, probs, routing_map)
    assert static[0].shape[0] == 64 * 3
    for ours, theirs in zip(static, found):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tokens,experts,topk", [(64, 8, 3), (37, 16, 1), (50, 64, 8)])
def test_dropless_permutation_counts_rows_without_sorting(tokens, experts, topk):
    """The sort-free dropless permutation (each token's row: its expert's first row plus the
    tokens before it that chose that expert) gives the rows of the ascending (expert, token)
    sort: token indices, probs and counts of `nonzero`, and each token's rows in row order,
    as a stable argsort of the token indices gives them."""
    from megatron.core.transformer.moe.token_dispatcher import _permutation, token_major

    generator = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[::5] = 0.5  # rows of ties
    probs, routing_map = routing.topk_routing(logits, topk=topk)
    positions = routing_map.t().reshape(-1).nonzero().squeeze(1)
    dropless = _permutation(probs, routing_map, topk)
    assert torch.equal(dropless[1], positions % tokens)
    assert torch.equal(dropless[0], probs.t().reshape(-1)[positions])
    assert dropless[2].tolist() == routing_map.sum(dim=0).tolist()
    assert torch.equal(dropless[3], token_major(positions % tokens, topk))
    assert dropless[1].dtype == torch.int64 and dropless[3].shape == (tokens, topk)


def test_per_token_combine_and_gather_gradient_sum_each_tokens_rows_once():
    """Dropless top-k: the combine and the tokens' gradient gather each token's k rows and sum
    them in fp32, rounded once (no atomic adds into [T, H]); values and gradients equal the
    index_add path's in fp64 and a bf16 combine equals the fp32 sum rounded once."""
    generator = torch.Generator().manual_seed(3)
    probs, routing_map = routing.topk_routing(torch.randn(40, 8, generator=generator), topk=3)
    hidden = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    results = []
    for per_token in (None, 3):
        leaf = hidden.clone().requires_grad_()
        rows, row_probs, token_indices, _ = permute(leaf, probs.double(), routing_map,
                                                    per_token=per_token)  # fmt: skip
        expert_out = rows * torch.linspace(0.5, 2.0, rows.shape[0], dtype=torch.float64)[:, None]
        out = unpermute(expert_out, row_probs, token_indices, num_tokens=40, per_token=per_token)
        (out * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        results.append((out.detach(), leaf.grad))
    for plain, per_token in zip(*results):
        torch.testing.assert_close(per_token, plain, rtol=1e-12, atol=1e-12)
    assert results[1][1].abs().sum() > 0
    rows = torch.randn(120, 16, generator=generator).bfloat16()
    _, _, token_indices, _ = permute(hidden.float(), probs, routing_map, per_token=3)
    got = unpermute(rows, torch.ones(120), token_indices, num_tokens=40, per_token=3)
    want = torch.zeros(40, 16).index_add(0, token_indices, rows.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_dropless_dispatch_and_combine_compile_into_one_graph():
    """The per-token gather-and-sum combine and its gradient trace with fullgraph=True (no host
    sync, no data-dependent shape), forward and backward equal to eager."""
    from megatron.core.transformer.moe.token_dispatcher import alltoall_dispatch_combine

    generator = torch.Generator().manual_seed(5)
    probs, routing_map = routing.topk_routing(torch.randn(24, 4, generator=generator), topk=2)
    hidden = torch.randn(24, 6, generator=generator)

    def layer(x):
        experts = lambda tokens, counts, segments: tokens * 1.5 + tokens.square()  # noqa: E731
        out = alltoall_dispatch_combine(
            x, probs, routing_map, experts=experts, group=None, per_token=2
        )
        return (out * torch.arange(6.0)).sum()

    grads = []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        x = hidden.clone().requires_grad_()
        loss = fn(x)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])


def test_experts_take_device_counts_in_one_graph(monkeypatch):
    """The routed experts read tokens-per-expert as a tensor where torch._grouped_mm runs both
    GEMMs (CUDA bf16): no host sync, so torch.compile traces them in one graph (fullgraph).
    Here torch._grouped_mm's CPU forward stands in for CUDA's (its CPU kernel has no
    backward); the result equals the per-expert matmul loop that host counts take."""
    from megatron.core.transformer.moe import experts as experts_module
    from megatron.core.transformer.moe.experts import GroupedExperts

    config = moe_config(swiglu=True, moe_ffn_hidden_size=16, params_dtype=torch.bfloat16)
    experts = GroupedExperts(config, num_local_experts=EXPERTS).to(torch.bfloat16)
    fill_parameters(experts, seed=3)
    generator = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 0, 9, 2])
    tokens = torch.randn(int(counts.sum()), config.hidden_size, generator=generator)
    tokens = tokens.to(torch.bfloat16)
    with torch.no_grad():
        looped = experts(tokens, counts.tolist())
        monkeypatch.setattr(experts_module, "_grouped_mm_runs", lambda tokens, weight: True)
        assert experts._device_counts_suffice(tokens)
        grouped = torch.compile(experts, fullgraph=True, backend="aot_eager")(tokens, counts)
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shared", [None, "plain", "gated"])
def test_moe_layer_matches_token_loop_reference(swiglu, shared):
    config = moe_config(
        swiglu=swiglu,
        moe_shared_expert_intermediate_size=None if shared is None else 12,
        moe_shared_expert_gate=shared == "gated",
    )
    layer = MoELayer(config, layer_number=1)
    fill_parameters(layer, seed=2)
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    target = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    out = layer(x)
    (out * target).sum().backward()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    expected = reference_moe(x_ref.flatten(0, 1), params, config).view_as(x)
    (expected * target).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for name, param in layer.named_parameters():
        # Token-order sums differ from the reference loop: fp32 rounding of ~10 terms.
        torch.testing.assert_close(param.grad, params[name].grad, rtol=1e-5, atol=1e-6)


def test_moe_layer_with_capacity_drops_and_pads():
    config = moe_config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    metrics = MoEMetrics()
    layer = MoELayer(config, layer_number=1, metrics=metrics)
    fill_parameters(layer, seed=5)
    x = torch.randn(1, 8, config.hidden_size, generator=torch.Generator().manual_seed(6))
    chosen = routing.topk_routing(x[0] @ layer.router.weight.detach().t(), topk=2)[1]
    probs, routing_map = layer.router(x)
    # 16 choices, at most 2 kept per expert of 4: the dropped fraction is exact.
    kept = int((chosen & routing_map).sum())
    assert metrics.per_layer("dropped_token_fraction")[1] == pytest.approx(1 - kept / 16)
    assert kept <= 8
    # capacity ceil(8 * 2 / 4 * 0.5) = 2: every expert runs exactly 2 tokens (padded).
    assert routing_map.sum(dim=0).tolist() == [2, 2, 2, 2]
    out = layer(x).flatten(0, 1)
    weights = layer.experts
    expected = torch.zeros_like(out)
    for token, expert in routing_map.nonzero().tolist():
        fc1 = weights.linear_fc1.weight[expert]
        fc2 = weights.linear_fc2.weight[expert]
        value = torch.nn.functional.gelu(x[0, token] @ fc1.t()) @ fc2.t()
        expected[token] += probs[token, expert] * value
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_layer_freq_builds_moe_layers():
    config = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1])
    kinds = [type(TransformerLayer(config, layer_number=n).mlp).__name__ for n in (1, 2, 3)]
    assert kinds == ["MLP", "MoELayer", "MoELayer"]


def _tiny_moe_gpt(aux_coeff: float) -> GPTModel:
    config = tiny_config(
        num_layers=3,
        add_bias_linear=False,
        swiglu=True,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1],
        moe_shared_expert_intermediate_size=16,
        moe_router_topk=2,
        moe_aux_loss_coeff=aux_coeff,
        moe_token_dispatcher_type="alltoall",
    )
    return GPTModel(config, seed=7)


def test_tiny_moe_gpt_trains_and_aux_loss_reaches_grads():
    model = _tiny_moe_gpt(aux_coeff=0.05)
    tokens = token_batch(batch=4, seq=8, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    metrics = model.decoder.moe_metrics.report()
    assert set(metrics) == {"load_balancing_loss"}
    assert 1.0 <= metrics["load_balancing_loss"] < 4.0  # 1 is perfect balance, E = 4 worst


def test_aux_loss_gradient_in_gpt_equals_reference_aux_grad():
    with_aux, without_aux = _tiny_moe_gpt(aux_coeff=0.05), _tiny_moe_gpt(aux_coeff=0.0)
    without_aux.load_state_dict(with_aux.state_dict())
    tokens = token_batch(batch=2, seq=8, seed=3)
    router_inputs = {}
    for number in (2, 3):
        router = with_aux.decoder.layers[number - 1].mlp.router
        router.register_forward_hook(
            lambda module, args, out, n=number: router_inputs.__setitem__(n, args[0].detach())
        )
    for model in (with_aux, without_aux):
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    # The last MoE layer only: layer 2's router also gets layer 3's aux-loss grad through
    # layer 3's input.
    for number in (3,):
        weight = with_aux.decoder.layers[number - 1].mlp.router.weight
        difference = weight.grad - without_aux.decoder.layers[number - 1].mlp.router.weight.grad
        reference_weight = weight.detach().clone().requires_grad_()
        scores = torch.softmax(router_inputs[number].flatten(0, 1) @ reference_weight.t(), -1)
        counts = torch.zeros(4)
        for row in scores.detach():
            counts[row.topk(2).indices] += 1
        aux = 0.05 * 4 * torch.sum(counts / (scores.shape[0] * 2) * scores.mean(dim=0))
        (expected,) = torch.autograd.grad(aux, reference_weight)
        assert expected.abs().max() > 1e-4
        torch.testing.assert_close(difference, expected, rtol=1e-4, atol=1e-7)


def _tiny_moe_gpt_recomputing(granularity, modules=("core_attn",)) -> GPTModel:
    config = _tiny_moe_gpt(aux_coeff=0.05).config
    config.recompute_granularity, config.recompute_modules = granularity, modules
    return GPTModel(config, seed=7)


@pytest.mark.parametrize(
    "granularity, modules",
    [("full", ("core_attn",)), ("selective", ("moe",)), ("selective", ("shared_experts", "mlp"))],
)
def test_recompute_counts_router_metrics_once(granularity, modules):
    # Full recompute and the selective MoE modules (Megatron-LM's --recompute-modules moe,
    # shared_experts; mlp checkpoints the dense first layer): the same loss, grads and router
    # counts as no recompute, and the MoE layers really run under checkpoint.
    tokens = token_batch(batch=2, seq=8, seed=4)
    results = []
    for model in (_tiny_moe_gpt_recomputing(None), _tiny_moe_gpt_recomputing(granularity, modules)):
        runs = []  # forwards of: the dense MLP, routed experts, shared experts
        for name, module in [("mlp", model.decoder.layers[0].mlp)] + [
            (part, getattr(layer.mlp, part))
            for layer in model.decoder.layers[1:]
            for part in ("experts", "shared_experts")
        ]:
            module.register_forward_pre_hook(lambda *_, name=name, runs=runs: runs.append(name))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        metrics = model.decoder.moe_metrics
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append(
            (loss, metrics.per_layer("load_balancing_loss"), metrics.tokens_per_expert, grads)
        )
        results[-1] += ({part: runs.count(part) for part in ("mlp", "experts", "shared_experts")},)
    (plain_loss, plain_aux, plain_tokens, plain_grads, plain_runs) = results[0]
    (re_loss, re_aux, re_tokens, re_grads, re_runs) = results[1]
    assert torch.equal(plain_loss, re_loss)
    assert plain_aux == re_aux and len(plain_aux) == 2
    for layer in (2, 3):
        assert torch.equal(plain_tokens[layer], re_tokens[layer])
        assert plain_tokens[layer].sum().item() == 2 * 7 * 2  # tokens x top-k, counted once
    assert plain_grads.keys() == re_grads.keys()
    for name, grad in re_grads.items():
        assert torch.equal(grad, plain_grads[name]), name
    # Each part runs again in backward where it is recomputed (once per forward otherwise).
    assert plain_runs == {"mlp": 1, "experts": 2, "shared_experts": 2}
    whole = granularity == "full"
    assert re_runs == {
        "mlp": 2 if whole or "mlp" in modules else 1,
        "experts": 4 if whole or "moe" in modules else 2,
        "shared_experts": 4,
    }


def test_mtp_router_records_under_its_own_layer_number():
    """With MTP, the MTP layer's MoE router records under num_layers + depth (Megatron-LM's
    numbering), so the decoder's last layer keeps its own per-layer aux loss and token counts:
    the last layer's values equal those of the same model without MTP."""
    tokens = token_batch(batch=2, seq=8, seed=5)
    metrics = []
    for depths in (None, 1):
        config = _tiny_moe_gpt(aux_coeff=0.05).config
        config.mtp_num_layers = depths
        model = GPTModel(config, seed=7)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        metrics.append(model.decoder.moe_metrics)
    plain, with_mtp = metrics
    assert sorted(plain.per_layer("load_balancing_loss")) == [2, 3]
    assert sorted(with_mtp.per_layer("load_balancing_loss")) == [2, 3, 4]
    for layer in (2, 3):
        assert with_mtp.per_layer("load_balancing_loss")[layer] == pytest.approx(
            plain.per_layer("load_balancing_loss")[layer], rel=1e-6
        )
        assert torch.equal(with_mtp.tokens_per_expert[layer], plain.tokens_per_expert[layer])
    assert with_mtp.tokens_per_expert[4].sum().item() == 2 * 7 * 2  # the MTP layer's own
