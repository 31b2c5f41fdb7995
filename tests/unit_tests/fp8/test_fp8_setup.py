"""apply_fp8_setup: the recipe and the amax-reduction group given once at model setup, in place
of an fp8_autocast around every call. Training under it equals training under fp8_autocast
bitwise, delayed scaling's scales and amax histories included."""

from __future__ import annotations

import torch

from megatron.core.fp8 import Fp8Config, fp8_autocast
from megatron.core.fp8.linear import Fp8Linear, apply_fp8_setup

CONFIG = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=4)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        Fp8Linear(64, 32, bias=False, fp8_config=CONFIG),
        torch.nn.ReLU(),
        Fp8Linear(32, 64, bias=True, fp8_config=CONFIG),
    )


def _train(model: torch.nn.Module, *, autocast: bool) -> list[torch.Tensor]:
    outputs = []
    for step in range(3):
        torch.manual_seed(100 + step)
        x = torch.randn(16, 64) * (step + 1)
        if autocast:
            with fp8_autocast(model, enabled=True, fp8_config=CONFIG):
                y = model(x)
        else:
            y = model(x)
        y.square().sum().backward()
        outputs.append(y.detach())
    return outputs


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for index in (0, 2):
        for role, meta in model[index].delayed_scaling.metas.items():
            state[f"{index}.{role}.scale"] = meta.scale.clone()
            state[f"{index}.{role}.history"] = meta.amax_history.clone()
    return state


def test_setup_trains_as_fp8_autocast_does_bitwise():
    under_autocast, under_setup = _model(), _model()
    setup = apply_fp8_setup(under_setup, fp8_config=CONFIG, amax_reduction_group=None)
    assert all(under_setup[i].fp8_setup is setup for i in (0, 2))
    want, got = _train(under_autocast, autocast=True), _train(under_setup, autocast=False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    want_state, got_state = _state(under_autocast), _state(under_setup)
    assert want_state.keys() == got_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    # The histories moved: three forward flushes (input, weight) and three backward ones.
    assert int((got_state["0.input.history"] != 0).sum()) == 3
    assert int((got_state["0.grad.history"] != 0).sum()) == 3
    assert not setup.pending  # flushed when each forward ended


def test_an_active_autocast_takes_precedence_over_the_setup():
    model = _model()
    setup = apply_fp8_setup(model, fp8_config=CONFIG, amax_reduction_group=None)
    x = torch.randn(4, 64)
    with fp8_autocast(model, enabled=False):
        y = model(x)
    # enabled=False runs the Linears in high precision: nothing quantized, nothing recorded.
    hidden = torch.relu(torch.nn.functional.linear(x, model[0].weight))
    assert torch.equal(y, torch.nn.functional.linear(hidden, model[2].weight, model[2].bias))
    assert not setup.pending
    for meta in model[0].delayed_scaling.metas.values():
        assert int((meta.amax_history != 0).sum()) == 0
