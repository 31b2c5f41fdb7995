"""Gradient accumulation fusion for FP8 weights (Megatron-LM's --gradient-accumulation-fusion):
an FP8 weight whose engine attached a `main_grad_sink` gets its wgrad GEMM written into the
sink's buffer in fp32, eager and compiled (megatron_fp8::fp8_weight_backward), and autograd gets
no weight grad. CPU: the reference GEMM's fp32 product is what both paths round, so the fused
fp32 grad rounded to bf16 equals the unfused bf16 grad bitwise."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import Fp8Config, fp8_autocast
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.linear import Fp8Linear
from megatron.core.fp8.param_init import quantized_model_init

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


class BufferSink:
    """What the engine provides: one flat fp32 buffer with a slot per weight."""

    def __init__(self, weights: list[torch.Tensor], dtype=torch.float32) -> None:
        self.offsets, total = {}, 0
        for weight in weights:
            self.offsets[id(weight)] = (total, total + weight.numel())
            total += weight.numel()
        self.buffer = torch.full((total,), float("nan"), dtype=dtype)
        self.written: list[int] = []

    def main_grad_slot(self, weight):
        lo, hi = self.offsets[id(weight)]
        return self.buffer[lo:hi], id(weight) in self.written

    def main_grad_written(self, weight) -> None:
        self.written.append(id(weight))

    def grad(self, weight) -> torch.Tensor:
        lo, hi = self.offsets[id(weight)]
        return self.buffer[lo:hi].view(weight.shape)


def _model(recipe: str, device: str = "cpu") -> torch.nn.Sequential:
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    torch.manual_seed(0)
    with torch.device(device), quantized_model_init(recipe=recipe):
        return torch.nn.Sequential(
            Fp8Linear(256, 128, bias=False, fp8_config=config, dtype=torch.bfloat16),
            torch.nn.ReLU(),
            Fp8Linear(128, 256, bias=True, fp8_config=config, dtype=torch.bfloat16),
        )


def _backward(model, x: torch.Tensor, recipe: str, micro_batches: int = 1) -> torch.Tensor:
    x = x.detach().requires_grad_()
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    for chunk in x.chunk(micro_batches):
        with fp8_autocast(model, enabled=True, fp8_config=config):
            y = model(chunk)
        y.float().square().sum().backward()
    return x.grad


def _weights(model) -> list[torch.Tensor]:
    return [model[0].weight, model[2].weight]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_wgrad_is_the_fp32_product_that_autograd_rounds(recipe: str):
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    plain = _model(recipe)
    dx_plain = _backward(plain, x, recipe)
    fused = _model(recipe)
    sink = BufferSink(_weights(fused))
    for weight in _weights(fused):
        weight.main_grad_sink = sink
    dx_fused = _backward(fused, x, recipe)

    assert torch.equal(dx_fused, dx_plain)
    assert sink.written == [id(w) for w in reversed(_weights(fused))]  # backward order
    for got_w, want_w in zip(_weights(fused), _weights(plain), strict=True):
        assert got_w.grad is None  # autograd got no weight grad
        got, want = sink.grad(got_w), want_w.grad
        assert got.dtype == torch.float32 and want.dtype == torch.bfloat16
        assert torch.equal(got.to(torch.bfloat16), want)
        # fp32 keeps what bf16 rounds away: the grads differ below bf16's precision.
        assert not torch.equal(got, want.float())
        assert (got - want.float()).abs().max() <= want.float().abs().max() * 2**-8
    assert torch.equal(fused[2].bias.grad, plain[2].bias.grad)  # biases: autograd as before


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_second_micro_batch_adds_its_fp32_product(recipe: str):
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    one = _model(recipe)
    sink_one = BufferSink(_weights(one))
    for weight in _weights(one):
        weight.main_grad_sink = sink_one
    # Micro-batch 2 alone, into a fresh buffer: the product that the accumulating run adds.
    _backward(one, x[32:], recipe)
    two = _model(recipe)
    sink_two = BufferSink(_weights(two))
    for weight in _weights(two):
        weight.main_grad_sink = sink_two
    _backward(two, x, recipe, micro_batches=2)
    first = _model(recipe)
    sink_first = BufferSink(_weights(first))
    for weight in _weights(first):
        weight.main_grad_sink = sink_first
    _backward(first, x[:32], recipe)
    assert len(sink_two.written) == 4
    for w_two, w_one, w_first in zip(_weights(two), _weights(one), _weights(first), strict=True):
        want = sink_first.grad(w_first) + sink_one.grad(w_one)
        assert torch.equal(sink_two.grad(w_two), want)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_compiled_fused_wgrad_equals_eager(recipe: str):
    """The compiled backward writes the grads through megatron_fp8::fp8_weight_backward (not
    dropped as an unused op): the same buffer as eager, bitwise, and no weight grad."""
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    eager = _model(recipe)
    sink_eager = BufferSink(_weights(eager))
    for weight in _weights(eager):
        weight.main_grad_sink = sink_eager
    dx_eager = _backward(eager, x, recipe)

    model = _model(recipe)
    sink = BufferSink(_weights(model))
    for weight in _weights(model):
        weight.main_grad_sink = sink
    prepare_for_compile(model)
    model.forward = torch.compile(model.forward)
    torch._dynamo.reset()
    try:
        dx = _backward(model, x, recipe)
    finally:
        torch._dynamo.reset()
    assert torch.equal(dx, dx_eager)
    assert sink.written == [id(w) for w in reversed(_weights(model))]
    assert torch.equal(sink.buffer, sink_eager.buffer)
    assert all(w.grad is None for w in _weights(model))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_fused_wgrad_writes_its_slot_and_matches_bf16_grads(recipe: str):
    """GPU twin: the wgrad GEMM writes each weight's fp32 slot in place (the NaN fill around
    and between the slots stays), and the bf16 grads of the unfused path are that product
    rounded (cuBLAS may pick another kernel per output dtype: within one bf16 rounding)."""
    x = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    plain, fused = _model(recipe, "cuda"), _model(recipe, "cuda")
    _backward(plain, x, recipe)
    weights = _weights(fused)
    sink = BufferSink([torch.empty(16), *weights, torch.empty(16)])
    sink.buffer = sink.buffer.cuda()
    for weight in weights:
        weight.main_grad_sink = sink
    _backward(fused, x, recipe)
    assert sink.written == [id(w) for w in reversed(weights)]
    assert torch.isnan(sink.buffer[:16]).all() and torch.isnan(sink.buffer[-16:]).all()
    assert not torch.isnan(sink.buffer[16:-16]).any()
    for got_w, want_w in zip(weights, _weights(plain), strict=True):
        got, want = sink.grad(got_w), want_w.grad.float()
        assert (got - want).abs().max() <= want.abs().max() * 2**-7, recipe
