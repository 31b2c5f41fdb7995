"""Router math against plain-torch references written here: scores, top-k variants, the
load-balancing losses and z-loss (values and grads), capacity, expert bias, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.transformer.moe import routing
from megatron.core.transformer.moe.config_checks import check_moe_config, moe_layer_pattern
from megatron.core.transformer.moe.metrics import MoEMetrics, attach_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.mtp import MTPMetrics
from tests.unit_tests.models.moe.moe_helpers import fill_parameters, moe_config, reference_topk

T, E, K = 12, 8, 2


def _logits(seed: int = 0, tokens: int = T, experts: int = E) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def _dense(probs_by_token: list[dict[int, float]]) -> torch.Tensor:
    out = torch.zeros(len(probs_by_token), E)
    for token, chosen in enumerate(probs_by_token):
        for expert, prob in chosen.items():
            out[token, expert] = prob
    return out


def _reference_routing(logits, *, score, pre_softmax=False, scale=None, bias=None, groups=None):
    rows = []
    for row in logits:
        if score == "softmax":
            full = torch.exp(row) / torch.exp(row).sum()
            choice_scores = full if pre_softmax else row
        else:
            full = 1 / (1 + torch.exp(-row))
            choice_scores = full if bias is None else full + bias
        if groups is None:
            chosen = reference_topk(choice_scores, K)
        else:
            num_groups, group_topk = groups
            size = E // num_groups
            group_score = [
                sum(sorted(choice_scores[g * size : (g + 1) * size].tolist())[-K // group_topk :])
                for g in range(num_groups)
            ]
            best = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [e for e in range(E) if e // size in best]
            chosen = sorted(allowed, key=lambda e: -float(choice_scores[e]))[:K]
        if score == "softmax" and not pre_softmax:
            weights = torch.exp(row[chosen]) / torch.exp(row[chosen]).sum()
        elif score == "softmax":
            weights = full[chosen]
        else:
            weights = full[chosen] / full[chosen].sum()
        weights = weights * (scale or 1.0)
        rows.append(dict(zip(chosen, weights.tolist(), strict=True)))
    return _dense(rows)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(score="softmax"),
        dict(score="softmax", pre_softmax=True),
        dict(score="sigmoid"),
        dict(score="softmax", scale=2.5),
        dict(score="sigmoid", groups=(4, 2)),
        dict(score="softmax", pre_softmax=True, groups=(2, 1)),
    ],
)
def test_topk_routing_matches_reference(kwargs):
    logits = _logits()
    groups = kwargs.get("groups")
    probs, routing_map = routing.topk_routing(
        logits,
        topk=K,
        score_function=kwargs["score"],
        pre_softmax=kwargs.get("pre_softmax", False),
        num_groups=groups[0] if groups else None,
        group_topk=groups[1] if groups else None,
        scaling_factor=kwargs.get("scale"),
    )
    expected = _reference_routing(logits, **kwargs)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, expected != 0)
    assert routing_map.sum(dim=1).tolist() == [K] * T


def test_group_limited_routing_stays_in_chosen_groups():
    logits = _logits(3)
    _, routing_map = routing.topk_routing(logits, topk=K, num_groups=4, group_topk=1)
    # One group of 2 experts per token, so both picks are that group's two experts.
    for row in routing_map:
        experts = row.nonzero().flatten().tolist()
        assert experts[0] // 2 == experts[1] // 2


def test_expert_bias_changes_choice_not_probs():
    logits = _logits(1)
    bias = torch.zeros(E)
    bias[5] = 10.0  # large enough to force expert 5 into every token's top-k
    probs, routing_map = routing.topk_routing(
        logits, topk=K, score_function="sigmoid", expert_bias=bias
    )
    assert routing_map[:, 5].all()
    expected = _reference_routing(logits, score="sigmoid", bias=bias)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)


def _reference_aux_loss(logits, coeff):
    scores = torch.softmax(logits, dim=-1)
    counts = torch.zeros(E)
    for row in scores:
        for expert in reference_topk(row, K):
            counts[expert] += 1
    fraction = counts / (logits.shape[0] * K)
    mean_prob = scores.mean(dim=0)
    return coeff * E * torch.sum(fraction * mean_prob)


def test_aux_loss_value_and_grad():
    logits = _logits(2).requires_grad_()
    routing_map, scores = routing.scores_for_aux_loss(logits, topk=K, score_function="softmax")
    loss = routing.aux_loss(scores, routing_map, topk=K, coeff=0.01)
    (grad,) = torch.autograd.grad(loss, logits)
    reference_logits = logits.detach().clone().requires_grad_()
    expected = _reference_aux_loss(reference_logits, 0.01)
    (expected_grad,) = torch.autograd.grad(expected, reference_logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-9)
    # Perfectly balanced uniform scores give exactly coeff (E * sum of 1/E * 1/E * E).
    flat = torch.zeros(E, E)
    flat_map = torch.eye(E, dtype=torch.bool)
    assert routing.aux_loss(torch.softmax(flat, -1), flat_map, topk=1, coeff=0.5).item() == 0.5


def test_seq_aux_loss_is_mean_of_per_sequence_aux_losses():
    batch, seq = 3, 4
    logits = _logits(4, tokens=batch * seq).requires_grad_()
    routing_map, scores = routing.scores_for_aux_loss(logits, topk=K, score_function="softmax")
    loss = routing.seq_aux_loss(scores, routing_map, batch=batch, topk=K, coeff=0.1)
    reference_logits = logits.detach().clone().requires_grad_()
    per_sequence = [
        _reference_aux_loss(reference_logits[b * seq : (b + 1) * seq], 0.1) for b in range(batch)
    ]
    expected = sum(per_sequence) / batch
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, reference_logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-9)


def test_z_loss_value_and_grad():
    logits = (_logits(5) * 3).requires_grad_()
    loss = routing.z_loss(logits, coeff=1e-3)
    expected = 1e-3 * sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits)
    assert loss.item() == pytest.approx(expected / T, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    # d/dl of c/T * lse^2 = c/T * 2 lse * softmax(l)
    lse = torch.logsumexp(logits.detach(), dim=-1, keepdim=True)
    expected_grad = 1e-3 / T * 2 * lse * torch.softmax(logits.detach(), dim=-1)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-10)


def _skewed_routing():
    """8 tokens, 4 experts, top-2: every token picks expert 0 and one of 1..3."""
    probs = torch.zeros(8, 4)
    for token in range(8):
        probs[token, 0] = 0.5 + 0.05 * ((token * 3) % 8)  # distinct, not in token order
        probs[token, 1 + token % 3] = 1 - probs[token, 0]
    return probs, probs > 0


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drop_policies_and_padding(policy, pad):
    probs, routing_map = _skewed_routing()
    capacity = routing.expert_capacity(num_tokens=8, topk=2, num_experts=4, factor=1.0)
    assert capacity == 4
    out_probs, out_map = routing.drop_over_capacity(
        probs, routing_map, topk=2, capacity_factor=1.0, drop_policy=policy, pad_to_capacity=pad
    )
    column = probs[:, 0].tolist()
    if policy == "probs":
        kept = sorted(range(8), key=lambda t: -column[t])[:capacity]
    else:
        kept = [0, 1, 2, 3]
    assert sorted(out_map[:, 0].nonzero().flatten().tolist()) == sorted(kept)
    for expert in (1, 2, 3):  # 3 or 2 tokens each: under capacity, all kept
        routed = routing_map[:, expert]
        assert torch.equal(out_map[:, expert] & routed, routed)
        expected_count = capacity if pad else int(routed.sum())
        assert int(out_map[:, expert].sum()) == expected_count
    expected_probs = probs * (out_map & routing_map)
    assert torch.equal(out_probs, expected_probs)


def test_router_attaches_losses_to_grads_with_backward_scale():
    config = moe_config(num_moe_experts=E, moe_aux_loss_coeff=0.02, moe_z_loss_coeff=1e-3)
    metrics = MoEMetrics()
    metrics.set_backward_scale(0.5)
    router = TopKRouter(config, layer_number=1, metrics=metrics)
    fill_parameters(router, seed=0)
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    target = torch.randn(10, E, generator=torch.Generator().manual_seed(2))
    probs, _ = router(x)
    (0.5 * (probs * target).sum()).backward()
    weight = router.weight.detach().clone().requires_grad_()
    logits = x.flatten(0, 1) @ weight.t()
    ref_probs = _reference_routing(logits.detach(), score="softmax")
    mask = ref_probs != 0
    chosen = logits.masked_fill(~mask, float("-inf"))
    main = (torch.softmax(chosen, dim=-1) * target).sum()
    aux = _reference_aux_loss(logits, 0.02)
    z = 1e-3 * torch.logsumexp(logits, dim=-1).square().mean()
    (expected,) = torch.autograd.grad(0.5 * (main + aux + z), weight)
    torch.testing.assert_close(router.weight.grad, expected, rtol=1e-5, atol=1e-8)
    assert metrics.per_layer("load_balancing_loss")[1] == pytest.approx(aux.item() / 0.02, 1e-6)
    assert metrics.per_layer("z_loss")[1] == pytest.approx(z.item() / 1e-3, rel=1e-6)
    assert metrics.tokens_per_expert[1].sum().item() == 10 * K


def test_expert_bias_update_rule():
    config = moe_config(
        num_moe_experts=E, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    router = TopKRouter(config, layer_number=1)
    fill_parameters(router, seed=3)
    x = torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(4))
    _, routing_map = router(x)
    counts = routing_map.sum(dim=0).float()
    assert torch.equal(router.local_tokens_per_expert, counts)
    router.update_expert_bias()
    expected = 1e-3 * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, expected)
    assert router.local_tokens_per_expert.sum().item() == 0
    with torch.no_grad():  # evaluation does not count tokens
        router(x)
    assert router.local_tokens_per_expert.sum().item() == 0


def test_sinkhorn_balances_and_routes():
    balanced = routing.sinkhorn(_logits(6, tokens=8, experts=4))
    torch.testing.assert_close(balanced.sum(dim=0), torch.full((4,), 1 / 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(balanced.sum(dim=1), torch.full((8,), 1 / 8), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (dict(moe_router_topk=5), "--moe-router-topk 5"),
        (dict(expert_model_parallel_size=3), "--expert-model-parallel-size 3"),
        (dict(moe_router_group_topk=2), "--moe-router-num-groups"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=2, moe_router_topk=3), "divide"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=2), "exceeds"),
        (dict(moe_pad_expert_input_to_capacity=True), "--moe-expert-capacity-factor"),
        (dict(moe_router_enable_expert_bias=True), "sigmoid"),
        (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
        (dict(add_bias_linear=True), "--disable-bias-linear"),
        (dict(moe_layer_freq=[1, 0]), "--moe-layer-freq"),
        (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1), "sinkhorn"),
    ],
)
def test_config_checks_name_flag(overrides, words):
    with pytest.raises(ValueError, match=words.replace("-", r"\-")):
        check_moe_config(moe_config(**overrides))


def test_moe_layer_pattern():
    assert moe_layer_pattern(moe_config(num_layers=4, moe_layer_freq=2)) == [1, 0, 1, 0]
    pattern = moe_layer_pattern(moe_config(num_layers=3, moe_layer_freq=[0, 1, 1]))
    assert pattern == [False, True, True]
    assert moe_config(moe_ffn_hidden_size=None).moe_ffn_hidden_size == 4 * 16


def test_sinkhorn_router_chooses_by_balanced_scores_in_training_only():
    config = moe_config(
        num_moe_experts=E, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0
    )
    router = TopKRouter(config, layer_number=1)
    fill_parameters(router, seed=8)
    x = torch.randn(1, T, config.hidden_size, generator=torch.Generator().manual_seed(9))
    logits = x[0] @ router.weight.detach().t()
    activated = torch.softmax(logits, dim=-1)
    for training, choice in ((True, routing.sinkhorn(logits)), (False, activated)):
        router.train(training)
        with torch.set_grad_enabled(training):
            probs, routing_map = router(x)
        expected_map = torch.zeros(T, E, dtype=torch.bool)
        for token, row in enumerate(choice):
            expected_map[token, reference_topk(row, K)] = True
        assert torch.equal(routing_map, expected_map)
        torch.testing.assert_close(probs.detach(), activated * expected_map, rtol=1e-6, atol=0)


def test_router_dtype_fp64():
    config = moe_config(moe_router_dtype="fp64")
    router = TopKRouter(config, layer_number=1)
    fill_parameters(router, seed=1)
    probs, _ = router(torch.randn(1, 3, config.hidden_size))
    assert probs.dtype == torch.float64 and router.weight.dtype == torch.float32


@pytest.mark.parametrize("owner", ["moe", "mtp"])
def test_backward_scale_moves_to_the_named_device_once_then_refills_in_place(owner):
    metrics = MoEMetrics() if owner == "moe" else MTPMetrics(depths=1)
    metrics.set_backward_scale(0.5)  # no device named: stays on the host
    assert metrics.backward_scale.device.type == "cpu"
    assert metrics.backward_scale.item() == 0.5
    metrics.set_backward_scale(0.25, torch.device("meta"))
    moved = metrics.backward_scale
    assert moved.device.type == "meta" and moved.dtype == torch.float32 and moved.dim() == 0
    metrics.set_backward_scale(0.125, torch.device("meta"))
    assert metrics.backward_scale is moved  # refilled, not reallocated each step


def _aux_backward(metrics: MoEMetrics, device: str) -> torch.Tensor:
    x = torch.arange(4.0, device=device).requires_grad_()
    out = attach_aux_loss(x * 1.0, (x * x).sum(), metrics)
    out.sum().backward()
    return x.grad


@pytest.mark.gpu
def test_aux_loss_backward_on_cuda_makes_no_host_synchronization():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the host-to-device copy this guards against exists only there")
    on_device = MoEMetrics()
    on_device.set_backward_scale(0.5, torch.device("cuda"))
    on_host = MoEMetrics()
    on_host.set_backward_scale(0.5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        grad = _aux_backward(on_device, "cuda")
        with pytest.raises(RuntimeError, match="synchroniz"):  # the check can fail
            _aux_backward(on_host, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 1.0 + 0.5 * 2.0 * torch.arange(4.0)
    torch.testing.assert_close(grad.cpu(), expected)
