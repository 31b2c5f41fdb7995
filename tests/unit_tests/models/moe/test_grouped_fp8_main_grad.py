"""Gradient accumulation fusion for the routed experts' FP8 parameters (moe/grouped_fp8.py,
fp8/main_grad.py): a stacked FP8 expert weight whose engine attached a `main_grad_sink` gets
its weight gradient written into the sink's buffer by the grouped wgrad itself, in fp32,
eager and compiled (megatron_fp8::grouped_fp8_weight_backward), and autograd gets none.

CPU: the emulated wgrad sums each segment's fp32 product in the output's dtype, so an fp32
layer's fused grad equals its unfused grad bitwise at any segments (several segments of one
expert included), and a bf16 layer's fused fp32 grad rounded to bf16 equals the unfused bf16
grad bitwise where each expert has one segment (EP 1). GPU: the ragged-K kernel writes the
slot in place (the NaN fill around and between slots stays)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.cuda.grouped_gemm import grouped_scaled_mm_wgrad
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.moe import grouped_fp8
from tests.unit_tests.fp8.test_gradient_accumulation_fusion import BufferSink
from tests.unit_tests.models.moe.test_grouped_fp8_blockwise_params import (
    DEVICE_SEGMENTS,
    EP_SEGMENTS,
    EXPERTS,
    IN,
    OUT,
    _data,
    _layer,
)

RECIPES = ("tensorwise", "blockwise")


def _fused_layer(recipe, **options):
    layer = _layer(recipe, fp8_param=True, **options)
    sink = BufferSink([layer.weight])
    layer.weight.main_grad_sink = sink
    return layer, sink


def _backward(layer, x, dy, segments):
    tokens = x.detach().clone().requires_grad_()
    counts = [sum(c) for c in segments]
    y = layer(tokens, counts, segments)
    y.backward(dy)
    return y.detach(), tokens.grad


@pytest.mark.parametrize("segments", [DEVICE_SEGMENTS, EP_SEGMENTS], ids=["ep1", "ep-segments"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_layer_fused_grad_equals_the_unfused_grad(recipe, segments):
    x, dy = _data(segments, torch.float32)
    plain = _layer(recipe, fp8_param=True)
    y_plain, dx_plain = _backward(plain, x, dy, segments)
    fused, sink = _fused_layer(recipe)
    y, dx = _backward(fused, x, dy, segments)
    assert torch.equal(y, y_plain) and torch.equal(dx, dx_plain)
    assert fused.weight.grad is None and sink.written == [id(fused.weight)]
    got, want = sink.grad(fused.weight), plain.weight.grad
    assert torch.equal(got, want) and want.dtype == torch.float32
    # Every expert with rows got a grad, the one without none (zeros written, not NaN).
    rows = [sum(counts) for counts in segments]
    assert [bool(got[e].abs().max() > 0) for e in range(EXPERTS)] == [n > 0 for n in rows]


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_buffer_gets_the_fp32_segment_sum_rounded_once(recipe):
    """A bf16 grad buffer (--main-grads-dtype bf16): several segments of one expert summed in
    fp32 and rounded once into the slot, as the kernel does and as the engine rounds an
    unfused fp32 grad; a second micro-batch adds its fp32 product, rounded once again."""
    x, dy = _data(EP_SEGMENTS, torch.float32)
    plain = _layer(recipe, fp8_param=True)
    _backward(plain, x, dy, EP_SEGMENTS)
    fused = _layer(recipe, fp8_param=True)
    sink = BufferSink([fused.weight], dtype=torch.bfloat16)
    fused.weight.main_grad_sink = sink
    _backward(fused, x, dy, EP_SEGMENTS)
    want = plain.weight.grad.to(torch.bfloat16)
    assert torch.equal(sink.grad(fused.weight), want)
    _backward(fused, x, dy, EP_SEGMENTS)
    assert torch.equal(sink.grad(fused.weight), (want.float() + plain.weight.grad).to(want.dtype))


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_layer_fused_fp32_grad_rounds_to_the_unfused_bf16_grad(recipe):
    segments = DEVICE_SEGMENTS  # one segment per expert
    x, dy = _data(segments, torch.bfloat16)
    plain = _layer(recipe, dtype=torch.bfloat16, fp8_param=True)
    _, dx_plain = _backward(plain, x, dy, segments)
    fused, sink = _fused_layer(recipe, dtype=torch.bfloat16)
    _, dx = _backward(fused, x, dy, segments)
    assert torch.equal(dx, dx_plain) and fused.weight.grad is None
    got, want = sink.grad(fused.weight), plain.weight.grad
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16
    assert torch.equal(got.to(torch.bfloat16), want)
    assert not torch.equal(got, want.float())  # fp32 keeps what bf16 rounds away
    assert (got - want.float()).abs().max() <= want.float().abs().max() * 2**-8


@pytest.mark.parametrize("recipe", RECIPES)
def test_second_micro_batch_adds_its_fp32_product(recipe):
    segments = DEVICE_SEGMENTS
    x, dy = _data(segments, torch.bfloat16)
    layers = {}
    for name in ("first", "second", "both"):
        layers[name] = _fused_layer(recipe, dtype=torch.bfloat16)
    first, second = (x[:200], dy[:200]), (x[200:], dy[200:])
    split_a, split_b = [[154], [0], [46], [0]], [[0], [0], [254], [43]]
    _backward(layers["first"][0], *first, split_a)
    _backward(layers["second"][0], *second, split_b)
    both, sink = layers["both"]
    _backward(both, *first, split_a)
    _backward(both, *second, split_b)
    assert sink.written == [id(both.weight)] * 2
    want = sum(s.grad(layer.weight) for layer, s in (layers["first"], layers["second"]))
    assert torch.equal(sink.grad(both.weight), want)


def _watch_transposed_weights(monkeypatch) -> list:
    """Patch grouped_fp8 so that the wgrad write asserts every transposed expert weight made
    for a dgrad is freed by then (held through the write, it raised the fused backward's peak
    by the weight's bytes above the unfused one's); returns the list of writes checked."""
    made, checked = [], []
    stacked_operand, write_main_grad = grouped_fp8._stacked_operand, grouped_fp8._write_main_grad

    def watched_operand(stacked, usage):
        operand = stacked_operand(stacked, usage)
        if usage == "columnwise":  # the bytes' storage, so that no view of it escapes either
            made.append(StorageWeakRef(operand[0].untyped_storage()))
        return operand

    def checked_write(*args):
        assert made and all(ref.expired() for ref in made), "a transposed weight is alive"
        checked.append(len(made))
        return write_main_grad(*args)

    monkeypatch.setattr(grouped_fp8, "_stacked_operand", watched_operand)
    monkeypatch.setattr(grouped_fp8, "_write_main_grad", checked_write)
    return checked


def _watch_backward_lists(monkeypatch) -> list:
    """Patch grouped_fp8 so that the compiled fused backward op asserts its tensor list holds
    no tensor twice (per tensor, dy's rows and weight-gradient operand share their bytes:
    listed twice, Inductor fed the op two copies of them); returns the lists' lengths."""
    lengths, backward_operands = [], grouped_fp8._backward_operands

    def checked_operands(tensors, recipe):
        storages = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
        assert len(storages) == len(set(storages)), "a tensor is listed twice"
        lengths.append(len(tensors))
        return backward_operands(tensors, recipe)

    monkeypatch.setattr(grouped_fp8, "_backward_operands", checked_operands)
    return lengths


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_fused_grad_equals_eager(recipe, monkeypatch):
    """Compiled (the FP8 parameter as its stand-in): dgrad and the wgrad write are one op,
    megatron_fp8::grouped_fp8_weight_backward, whose output the graph keeps; the same buffer as
    eager, bitwise, and no grad for the weight or its stand-in. Eager and compiled, the dgrad's
    transposed weight is freed before the wgrad writes."""
    checked = _watch_transposed_weights(monkeypatch)
    lengths = _watch_backward_lists(monkeypatch)
    x, dy = _data(EP_SEGMENTS, torch.float32)
    eager, sink_eager = _fused_layer(recipe)
    y_eager, dx_eager = _backward(eager, x, dy, EP_SEGMENTS)
    layer, sink = _fused_layer(recipe)
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    prepare_for_compile(layer)
    torch._dynamo.reset()
    try:
        for step in range(2):  # the second call reuses the graph (and adds to the slot)
            y, dx = _backward(layer, x, dy, EP_SEGMENTS)
            assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager), step
    finally:
        torch._dynamo.reset()
    assert sink.written == [id(layer.weight)] * 2
    assert torch.equal(sink.buffer, 2 * sink_eager.buffer)  # x + x is exact
    assert layer.weight.grad is None and layer._weight_stand_in.grad is None
    assert checked == [1, 2, 3]  # one eager write, then two compiled ones
    assert lengths == [5 if recipe_spec(recipe).per_tensor else 6] * 2


@pytest.mark.slow
def test_inductor_gives_the_fused_backward_dy_bytes_once(monkeypatch):
    """Compiled by Inductor (the training backend), the tensorwise fused backward op gets one
    FP8 tensor of dy's shape: listed twice, Inductor wrote the same bytes into two buffers."""
    x, dy = _data(EP_SEGMENTS, torch.float32)
    layer, _ = _fused_layer("tensorwise")
    layer.forward = torch.compile(layer.forward, fullgraph=True)
    prepare_for_compile(layer)
    seen, backward_operands = [], grouped_fp8._backward_operands

    def counting_operands(tensors, recipe):
        seen.append([t for t in tensors if t.dtype.itemsize == 1 and t.shape == dy.shape])
        return backward_operands(tensors, recipe)

    monkeypatch.setattr(grouped_fp8, "_backward_operands", counting_operands)
    torch._dynamo.reset()
    try:
        _backward(layer, x, dy, EP_SEGMENTS)
    finally:
        torch._dynamo.reset()
    assert len(seen) == 1 and len(seen[0]) == 1, [[t.dtype for t in s] for s in seen]
    assert seen[0][0].dtype == torch.float8_e5m2


def test_wgrad_out_must_be_the_result_shape_and_dtype():
    spec = recipe_spec("tensorwise")
    a_t = torch.zeros(OUT, 256, dtype=torch.float8_e4m3fn)
    b_t = torch.zeros(IN, 256, dtype=torch.float8_e4m3fn)
    scales = dict(a_scale_inv=torch.ones(()), b_scale_inv=torch.ones(()), recipe=spec.name)
    out = torch.full((2, OUT, IN), float("nan"))
    got = grouped_scaled_mm_wgrad(a_t, b_t, group_sizes=[128, 128], out=out, **scales)
    assert got is out and torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(2, 144, 200\)"):
        grouped_scaled_mm_wgrad(a_t, b_t, group_sizes=[128, 128], out=out[:1], **scales)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        bad = out.to(torch.bfloat16)
        grouped_scaled_mm_wgrad(a_t, b_t, group_sizes=[128, 128], out=bad, **scales)


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("segment_group", [None, [0, 0, 1]], ids=["groups", "segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulate_adds_the_fp32_product_rounded_once(dtype, segment_group, device):
    """accumulate=True (a later micro-batch's write into the grad buffer): out + the fp32
    product, rounded to out's dtype once, what adding the fp32 product to out gives (CPU: the
    emulation; CUDA: the ragged-K kernel's epilogue, against its own fp32 product)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; its CPU twin runs instead")
    generator = torch.Generator().manual_seed(3)
    a_t = (torch.randn(OUT, 384, generator=generator) * 8).to(device, torch.float8_e4m3fn)
    b_t = (torch.randn(IN, 384, generator=generator) * 8).to(device, torch.float8_e4m3fn)
    sizes, scale_shape = [128, 256], ()
    if segment_group is not None:
        sizes, scale_shape = [128, 128, 128], (3,)
    scales = dict(a_scale_inv=torch.full(scale_shape, 0.5, device=device))
    scales.update(b_scale_inv=torch.full(scale_shape, 2.0, device=device))
    options = dict(group_sizes=sizes, recipe="tensorwise", segment_group=segment_group, **scales)
    product = grouped_scaled_mm_wgrad(a_t, b_t, **options)  # fp32
    start = torch.randn(product.shape, generator=generator).to(device, dtype)
    out = start.clone()
    got = grouped_scaled_mm_wgrad(a_t, b_t, out_dtype=dtype, out=out, accumulate=True, **options)
    assert got is out and product.abs().max() > 0
    assert torch.equal(out, (start.float() + product).to(dtype))
    with pytest.raises(ValueError, match="accumulate needs out"):
        grouped_scaled_mm_wgrad(a_t, b_t, accumulate=True, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [DEVICE_SEGMENTS, EP_SEGMENTS], ids=["ep1", "ep-segments"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_fused_expert_grad_writes_its_slot_in_place(recipe, segments):
    """GPU twin: the ragged-K kernel writes the expert weight's fp32 slot (between NaN-filled
    neighbours that stay NaN; several segments of one expert summed in the kernel), its bf16
    rounding is the unfused kernel's bf16 grad within one bf16 rounding (the kernel may tile
    another way per output dtype), and a second micro-batch adds its fp32 product exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; its CPU twins run instead")
    x, dy = _data(segments, torch.bfloat16, device="cuda")
    plain = _layer(recipe, dtype=torch.bfloat16, fp8_param=True, device="cuda")
    _, dx_plain = _backward(plain, x, dy, segments)
    fused = _layer(recipe, dtype=torch.bfloat16, fp8_param=True, device="cuda")
    neighbour = torch.empty(3, 5, device="cuda")
    sink = BufferSink([neighbour, fused.weight, neighbour.new_empty(7)])
    sink.buffer = sink.buffer.cuda()
    fused.weight.main_grad_sink = sink
    _, dx = _backward(fused, x, dy, segments)
    assert torch.equal(dx, dx_plain) and fused.weight.grad is None
    lo, hi = sink.offsets[id(fused.weight)]
    assert sink.buffer[:lo].isnan().all() and sink.buffer[hi:].isnan().all()
    got, want = sink.grad(fused.weight).clone(), plain.weight.grad
    assert not got.isnan().any() and got.dtype == torch.float32
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.to(torch.bfloat16).float(), want.float(), rtol=2**-7, atol=0)
    assert (got - want.float()).abs().max() <= scale * 2**-7
    _backward(fused, x, dy, segments)  # a second micro-batch: the same product added
    assert sink.written == [id(fused.weight)] * 2
    assert torch.equal(sink.grad(fused.weight), got + got)


@pytest.mark.gpu
def test_gpu_wgrad_write_tunes_without_a_copy_of_out():
    """The first launch at a new shape autotunes. Writing out (the first micro-batch's write
    into an expert grad slot) needs no copy of out while the configs are timed; adding into
    it (accumulate=True) does. Measured as the peak bytes allocated past what was live: both
    tunings also hold Triton's L2-flush buffer, so the adding one peaks a copy of out higher
    (equal peaks if both copied or neither did)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: autotuning runs only on the kernel")
    generator = torch.Generator().manual_seed(5)
    groups, n, k, tokens = 16, 1088, 1216, 256  # a shape no other test tunes
    a_t = (torch.randn(n, tokens, generator=generator) * 8).to("cuda", torch.float8_e4m3fn)
    b_t = (torch.randn(k, tokens, generator=generator) * 8).to("cuda", torch.float8_e4m3fn)
    options = dict(group_sizes=[16] * groups, recipe="tensorwise")
    options.update(
        a_scale_inv=torch.ones((), device="cuda"), b_scale_inv=torch.ones((), device="cuda")
    )
    peaks = []
    for accumulate in (False, True):
        out = torch.zeros(groups, n, k, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_allocated()
        grouped_scaled_mm_wgrad(a_t, b_t, out=out, accumulate=accumulate, **options)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - live)
    assert peaks[1] - peaks[0] >= out.nbytes  # 85 MB: one copy of out, the adding tuner's
