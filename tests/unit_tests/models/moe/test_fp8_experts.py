"""FP8 routed experts (issue 38): Fp8StackedLinear runs each expert as one Fp8Linear (bitwise,
forward and both grads, each segment on its own), within the dense Fp8Linear test bounds of
an fp64 reference, and GroupedExperts builds it under an FP8 recipe."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import Fp8Config, Fp8Linear, fp8_autocast
from megatron.core.transformer.moe.experts import GroupedExperts, StackedLinear
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from megatron.core.transformer.moe.token_dispatcher import alltoall_dispatch_combine
from tests.unit_tests.fp8.test_fp8_linear import (
    FP8_FLOOR,
    FPROP_BOUND,
    GRAD_BOUND,
    RECIPES,
    rel_err,
)
from tests.unit_tests.models.moe.moe_helpers import moe_config

EXPERTS, IN, OUT = 3, 64, 48
SEGMENTS = [[40, 24], [0, 56], [30, 0]]  # rows of each expert per source rank


def _stacked(recipe: str, fp8_format: str = "hybrid") -> Fp8StackedLinear:
    config = Fp8Config(recipe=recipe, fp8_format=fp8_format, amax_history_len=4)
    layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Experts of very different magnitudes: one shared scale would fail the bounds.
        magnitudes = torch.tensor([1.0, 300.0, 0.004]).view(EXPERTS, 1, 1)
        layer.weight.copy_(torch.randn(EXPERTS, OUT, IN, generator=generator) * magnitudes / 8)
    return layer


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(sum(counts) for counts in SEGMENTS)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=generator), torch.randn(rows, OUT, generator=generator)


def _run(layer, x, grad_y, steps: int = 2):
    counts = [sum(c) for c in SEGMENTS]
    for _ in range(steps):  # the second step runs delayed scaling with a real scale
        layer.zero_grad()
        x.grad = None
        with fp8_autocast(layer, fp8_config=layer.fp8_config):
            y = layer(x, counts, SEGMENTS)
        y.backward(grad_y)
    return y


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_gemms_within_dense_fp8_linear_bounds(recipe, fp8_format):
    layer = _stacked(recipe, fp8_format)
    x, grad_y = _data()
    x.requires_grad_()
    y = _run(layer, x, grad_y)
    x_ref = x.detach().double().requires_grad_()
    weight_ref = layer.weight.detach().double().requires_grad_()
    sizes = [sum(counts) for counts in SEGMENTS]
    pieces = x_ref.split(sizes)
    y_ref = torch.cat([piece @ weight_ref[e].t() for e, piece in enumerate(pieces)])
    y_ref.backward(grad_y.double())
    errors = {"fprop": rel_err(y, y_ref), "dgrad": rel_err(x.grad, x_ref.grad)}
    for e in range(EXPERTS):  # each expert on its own scale: its own relative error
        errors[f"wgrad{e}"] = rel_err(layer.weight.grad[e], weight_ref.grad[e])
        rows = slice(sum(sizes[:e]), sum(sizes[: e + 1]))
        errors[f"fprop{e}"] = rel_err(y[rows], y_ref[rows])
    assert FP8_FLOOR < errors.pop("fprop") < FPROP_BOUND, errors
    for name, error in errors.items():
        bound = FPROP_BOUND if name.startswith("fprop") else GRAD_BOUND[fp8_format]
        assert FP8_FLOOR < error < bound, (name, errors)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_segment_is_one_fp8_linear_call_bitwise(recipe):
    """The one rule set: expert e's segment s gives exactly what an Fp8Linear holding
    weight[e] gives on that segment alone (forward, dgrad, wgrad summed over segments)."""
    layer = _stacked(recipe)
    x, grad_y = _data()
    x.requires_grad_()
    y = _run(layer, x, grad_y, steps=1)
    offset = 0
    for e, counts in enumerate(SEGMENTS):
        dense = Fp8Linear(IN, OUT, bias=False, fp8_config=layer.fp8_config)
        with torch.no_grad():
            dense.weight.copy_(layer.weight[e])
        rows = [slice(offset + sum(counts[:s]), offset + sum(counts[: s + 1])) for s in range(2)]
        offset += sum(counts)
        pieces = [x.detach()[r].clone().requires_grad_() for r in rows]
        with fp8_autocast(dense, fp8_config=dense.fp8_config):  # one step, as the stacked one
            outputs = [dense(piece) if piece.numel() else None for piece in pieces]
        used = [s for s in range(2) if outputs[s] is not None]
        torch.autograd.backward([outputs[s] for s in used], [grad_y[rows[s]] for s in used])
        for s in used:
            torch.testing.assert_close(y[rows[s]], outputs[s], rtol=0, atol=0)
            torch.testing.assert_close(x.grad[rows[s]], pieces[s].grad, rtol=0, atol=0)
        torch.testing.assert_close(layer.weight.grad[e], dense.weight.grad, rtol=0, atol=0)


def test_delayed_scaling_state_is_per_expert_and_round_trips():
    layer = _stacked("delayed")
    x, grad_y = _data()
    _run(layer, x.requires_grad_(), grad_y)
    scales = [s.metas["weight"].scale.item() for s in layer.delayed_scaling.experts]
    assert scales[1] < scales[0] < scales[2]  # larger weights, smaller scales
    assert scales[0] / scales[1] > 100
    state = layer.delayed_scaling.state_dict()
    experts = sorted({key.split(".")[0] for key in state if key != "metadata"})
    assert experts == [f"expert{e}" for e in range(EXPERTS)]
    fresh = _stacked("delayed")
    fresh.delayed_scaling.load_state_dict(state)
    for old, new in zip(layer.delayed_scaling.experts, fresh.delayed_scaling.experts):
        for role in ("input", "weight", "grad"):
            assert torch.equal(old.metas[role].scale, new.metas[role].scale)
            assert torch.equal(old.metas[role].amax_history, new.metas[role].amax_history)


def test_delayed_scaling_state_is_keyed_by_global_expert():
    """An expert-parallel rank holding experts 1 and 2 (first_expert 1) saves and loads them
    under their global indices: from one rank's state of all three, it takes its own; a
    state without one of them is refused."""
    layer = _stacked("delayed")
    x, grad_y = _data()
    _run(layer, x.requires_grad_(), grad_y)
    state = layer.delayed_scaling.state_dict()
    config = layer.fp8_config
    held = Fp8StackedLinear(2, IN, OUT, fp8_config=config, dtype=torch.float32, first_expert=1)
    assert sorted(held.delayed_scaling.metas)[:2] == ["grad.1", "grad.2"]
    held.delayed_scaling.load_state_dict(state)
    for local, scaling in enumerate(held.delayed_scaling.experts):
        source = layer.delayed_scaling.experts[1 + local]
        assert torch.equal(scaling.metas["weight"].scale, source.metas["weight"].scale)
        assert torch.equal(scaling.metas["grad"].amax_history, source.metas["grad"].amax_history)
    assert {key.split(".")[0] for key in held.delayed_scaling.state_dict()} == {
        "expert1",
        "expert2",
        "metadata",
    }
    without_2 = {k: v for k, v in state.items() if not k.startswith("expert2.")}
    with pytest.raises(ValueError, match="no delayed-scaling state for expert 2"):
        held.delayed_scaling.load_state_dict(without_2)


def test_grouped_experts_build_fp8_stacked_weights_under_a_recipe():
    fp8 = Fp8Config(recipe="blockwise")
    experts = GroupedExperts(moe_config(fp8=fp8, num_layers=2), num_local_experts=2, layer_number=2)
    assert isinstance(experts.linear_fc1, Fp8StackedLinear)
    assert tuple(experts.linear_fc2.weight.shape) == (2, 16, 8)
    bf16_last = Fp8Config(recipe="blockwise", num_layers_at_end_in_bf16=1)
    plain = GroupedExperts(
        moe_config(fp8=bf16_last, num_layers=2), num_local_experts=2, layer_number=2
    )
    assert isinstance(plain.linear_fc1, StackedLinear)
    assert isinstance(GroupedExperts(moe_config(), num_local_experts=2).linear_fc1, StackedLinear)


def test_dispatcher_hands_the_experts_their_source_rank_segments():
    """The allgather dispatcher's local step: tokens are `sources` equal source-rank blocks,
    and segments[e] counts expert e's rows from each block."""
    routing_map = torch.tensor(
        [[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool
    )
    hidden = torch.randn(6, 4)
    probs = torch.rand(6, 3)
    seen = []

    def experts(tokens, counts, segments):
        seen.append((counts, segments))
        return tokens

    alltoall_dispatch_combine(hidden, probs, routing_map, experts=experts, group=None, sources=2)
    assert seen == [([4, 3, 3], [[2, 2], [2, 1], [2, 1]])]
