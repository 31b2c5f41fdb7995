"""FP8 parameters inside compiled graphs (Fp8Linear.refresh_weight_stand_in): the graph takes a
zero-stride stand-in in the weight's place, the GEMMs read the weight through
megatron_fp8::fp8_weight_gemm, and the wgrad reaches the weight and its hooks. CPU twin of the
GPU layer test in test_compile.py (on CPU the reference path runs the same op and hooks)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.core.fp8 import Fp8Config, fp8_autocast
from megatron.core.fp8 import compile as fp8_compile
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.linear import Fp8Linear
from megatron.core.fp8.param_init import quantized_model_init


def _model(recipe: str) -> torch.nn.Sequential:
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    torch.manual_seed(0)
    with quantized_model_init(recipe=recipe):
        return torch.nn.Sequential(
            Fp8Linear(256, 128, bias=False, fp8_config=config, dtype=torch.bfloat16),
            torch.nn.ReLU(),
            Fp8Linear(128, 256, bias=True, fp8_config=config, dtype=torch.bfloat16),
        )


def _step(model: torch.nn.Module, x: torch.Tensor, recipe: str):
    """Output, input grad and weight grads of one forward/backward, and the weights' hook calls."""
    hook_calls = []
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: hook_calls.append(name))
    x = x.detach().requires_grad_()
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    with fp8_autocast(model, enabled=True, fp8_config=config):
        y = model(x)
    y.float().square().sum().backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return y.float(), x.grad.float(), grads, sorted(hook_calls)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "delayed"])
def test_compiled_fp8_parameters_equal_eager_through_their_stand_ins(recipe: str, monkeypatch):
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    eager = _step(_model(recipe), x, recipe)

    lookups = []
    find_weight = fp8_compile.stand_in_weight
    monkeypatch.setattr(
        fp8_compile, "stand_in_weight", lambda stand_in: lookups.append(1) or find_weight(stand_in)
    )
    model = _model(recipe)
    prepare_for_compile(model)
    model.forward = torch.compile(model.forward)
    torch._dynamo.reset()
    try:
        compiled = _step(model, x, recipe)
    finally:
        torch._dynamo.reset()

    # The reference path computes the same bytes and products in both runs: equal, not close.
    for got, want in zip(compiled[:2], eager[:2], strict=True):
        assert torch.equal(got, want)
    assert compiled[2].keys() == eager[2].keys()
    for name, want in eager[2].items():
        assert torch.equal(compiled[2][name], want), name
    # Every parameter's post-accumulate-grad hook ran once, FP8 weights' included.
    assert compiled[3] == eager[3] == ["0.weight", "2.bias", "2.weight"]
    # fprop of both Linears, dgrad of both (x requires grad), one wgrad hand-over each.
    assert len(lookups) == 6


def test_stand_in_has_the_weight_shape_and_one_element_of_storage():
    model = _model("tensorwise")
    linear = model[0]
    assert linear._weight_stand_in is None  # made before a compiled forward, not at build
    linear.refresh_weight_stand_in()
    stand_in = linear._weight_stand_in
    assert stand_in.shape == linear.weight.shape == (128, 256)
    assert stand_in.dtype == torch.bfloat16 and stand_in.stride() == (0, 0)
    assert stand_in.untyped_storage().nbytes() == 2
    assert stand_in.requires_grad and stand_in.is_leaf
    assert fp8_compile.stand_in_weight(stand_in) is linear.weight

    linear.refresh_weight_stand_in()  # nothing changed: the same stand-in
    assert linear._weight_stand_in is stand_in
    linear.weight.requires_grad_(False)  # a frozen weight gets a stand-in without grad
    linear.refresh_weight_stand_in()
    assert linear._weight_stand_in is not stand_in
    assert not linear._weight_stand_in.requires_grad

    # A copy of the module owns its own stand-in once refreshed.
    twin = copy.deepcopy(linear)
    twin.refresh_weight_stand_in()
    assert fp8_compile.stand_in_weight(twin._weight_stand_in) is twin.weight
    assert fp8_compile.stand_in_weight(linear._weight_stand_in) is linear.weight


def test_high_precision_weights_have_no_stand_in():
    config = Fp8Config(recipe="tensorwise", fp8_format="hybrid")
    linear = Fp8Linear(64, 32, bias=False, fp8_config=config)
    linear.refresh_weight_stand_in()
    assert linear._weight_stand_in is None


def test_stand_in_grad_accumulates_into_the_weight_and_runs_its_hooks():
    linear = _model("tensorwise")[0]
    linear.refresh_weight_stand_in()
    stand_in = linear._weight_stand_in
    seen = []
    linear.weight.register_post_accumulate_grad_hook(lambda w: seen.append(w.grad.clone()))
    first = torch.full((128, 256), 2.0, dtype=torch.bfloat16)
    second = torch.full((128, 256), 3.0, dtype=torch.bfloat16)
    for grad in (first, second):
        stand_in.grad = grad
        fp8_compile.deliver_stand_in_grad(stand_in)
        assert stand_in.grad is None
    assert [float(g[0, 0]) for g in seen] == [2.0, 5.0]
    assert torch.equal(linear.weight.grad, torch.full_like(first, 5.0))


def test_a_stand_in_without_its_linear_says_how_to_fix_it():
    orphan = torch.empty_strided((4, 4), (0, 0))
    with pytest.raises(RuntimeError, match="prepare_for_compile"):
        fp8_compile.stand_in_weight(orphan)
