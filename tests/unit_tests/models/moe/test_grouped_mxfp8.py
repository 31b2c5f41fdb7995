"""mxfp8 on the experts' grouped path (moe/grouped_mxfp8.py) against the per-segment path of
Fp8StackedLinear (one Fp8Linear call per expert and segment, fp8_experts.grouped_fp8_gemm).

CPU: bitwise equal (torch.equal) in forward, input gradient and weight gradient, for fp32 and
bf16 tokens and each fp8 format, on ragged segments (not multiples of the 32-row cell) with an
expert without rows, empty segments and several segments of one expert (expert parallelism),
K not a multiple of 32; on a high-precision weight and on a stacked FP8 parameter (rowwise and
columnwise bytes as the engine keeps them), whose backward reads the bytes gathered then, and
whose dW goes to its main_grad_sink when it has one. The columnwise copy of the tokens equals
quantizing each segment alone. An output dim that is not a multiple of 32 keeps the
per-segment path, and a compiled caller runs the call outside its graph, as delayed's.
GPU: torch._grouped_mm on the bf16 values equals the per-segment path's bf16 GEMMs within a
few bf16 roundings of the largest value (both multiply the same exact values with fp32
accumulation; a layout error would be off by the values themselves)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.transformer.moe import fp8_experts, grouped_mxfp8, grouped_operands
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from tests.unit_tests.fp8.test_gradient_accumulation_fusion import BufferSink
from tests.unit_tests.models.moe.test_grouped_fp8_blockwise_params import (
    EXPERTS as _SAME_EXPERTS,
)
from tests.unit_tests.models.moe.test_grouped_fp8_blockwise_params import _assert_bitwise

EXPERTS, IN, OUT = 4, 80, 64  # K not a multiple of 32: a short last cell
assert EXPERTS == _SAME_EXPERTS  # _assert_bitwise checks that many experts' gradients
SEGMENTS = [[40], [0], [56], [33]]  # expert 1 without rows
EP_SEGMENTS = [[40, 24], [0, 0], [0, 56], [30, 3]]  # two source ranks, empty segments
MANY_SEGMENTS = [[20, 17, 9], [5], [0], [11, 0, 2]]  # three segments of one expert


def _config(fp8_format="hybrid") -> Fp8Config:
    return Fp8Config(recipe="mxfp8", fp8_format=fp8_format)


def _fp8_parameter(weight: torch.Tensor, config: Fp8Config) -> torch.nn.Parameter:
    """The stacked mxfp8 parameter as the engine holds it: each expert quantized alone, rowwise
    and columnwise, bytes and E8M0 scales stacked along a leading expert dim."""
    fp8_dtype = fp8_dtype_for_role(config.fp8_format, "weight")
    options = dict(recipe="mxfp8", fp8_dtype=fp8_dtype, role="weight", backend="reference")
    parts = [quantize(weight[e], columnwise=True, **options) for e in range(weight.shape[0])]
    stacked = QuantizedTensor(
        shape=weight.shape,
        dtype=weight.dtype,
        recipe="mxfp8",
        fp8_dtype=fp8_dtype,
        role="weight",
        **{
            f"{d}_{part}": torch.stack([getattr(p, f"{d}_{part}") for p in parts])
            for d in ("rowwise", "columnwise")
            for part in ("data", "scale_inv")
        },
    )
    return torch.nn.Parameter(stacked)


def _layer(dtype=torch.float32, *, fp8_param=False, fp8_format="hybrid", out=OUT, device="cpu"):
    config = _config(fp8_format)
    layer = Fp8StackedLinear(EXPERTS, IN, out, fp8_config=config, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1.0, 3.0, 300.0, 0.004]).view(EXPERTS, 1, 1)
    weight = torch.randn(EXPERTS, out, IN, generator=generator) * magnitudes / 8
    weight[0, :, 40:] *= 50  # another magnitude from the second 32-wide cell on
    with torch.no_grad():
        layer.weight.copy_(weight.to(dtype))
    if fp8_param:
        layer.weight = _fp8_parameter(layer.weight.detach(), config)
    return layer


def _data(segments, dtype, out=OUT, device="cpu"):
    rows = sum(sum(c) for c in segments)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, IN, generator=generator) * torch.linspace(0.01, 40, rows)[:, None]
    dy = torch.randn(rows, out, generator=generator) * torch.linspace(3, 0.02, rows)[:, None]
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def _run(layer, x, dy, segments, grouped):
    layer.grouped = grouped
    layer.weight.grad = None
    tokens = x.detach().clone().requires_grad_()
    y = layer(tokens, [sum(c) for c in segments], segments)
    y.backward(dy)
    return y.detach(), tokens.grad, layer.weight.grad


def _counting(monkeypatch) -> list:
    calls = []
    real = grouped_mxfp8.grouped_mxfp8_linear
    monkeypatch.setattr(
        grouped_mxfp8, "grouped_mxfp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    return calls


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS, MANY_SEGMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_mxfp8_grouped_path_equals_the_per_segment_path_bitwise(
    segments, dtype, fp8_format, monkeypatch
):
    calls = _counting(monkeypatch)
    layer = _layer(dtype, fp8_format=fp8_format)
    x, dy = _data(segments, dtype)
    want = _run(layer, x, dy, segments, grouped=False)
    assert calls == []
    got = _run(layer, x, dy, segments, grouped=True)
    assert calls == [1]
    _assert_bitwise(got, want, segments)


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_fp8_parameter_grouped_equals_the_per_segment_path_bitwise(
    segments, dtype, monkeypatch
):
    calls = _counting(monkeypatch)
    layer = _layer(dtype, fp8_param=True)
    x, dy = _data(segments, dtype)
    want = _run(layer, x, dy, segments, grouped=False)
    got = _run(layer, x, dy, segments, grouped=True)
    assert calls == [1]
    _assert_bitwise(got, want, segments)


def test_the_fp8_parameter_backward_reads_the_bytes_gathered_then():
    """The engine re-gathers (re-points) the bytes between forward and backward: the data
    gradient reads the columnwise bytes present when backward runs, as `ExpertWeight` does."""
    layer, other = _layer(fp8_param=True), _layer(fp8_param=True)
    other_weight = _fp8_parameter(_layer().weight.detach() * 2, _config())
    x, dy = _data(SEGMENTS, torch.float32)
    tokens = x.clone().requires_grad_()
    y = layer(tokens, [sum(c) for c in SEGMENTS], SEGMENTS)
    layer.weight.columnwise_data = other_weight.columnwise_data
    layer.weight.columnwise_scale_inv = other_weight.columnwise_scale_inv
    y.backward(dy)
    other.weight = other_weight
    _, want_dx, _ = _run(other, x, dy, SEGMENTS, grouped=True)
    assert torch.equal(tokens.grad, want_dx) and want_dx.abs().max() > 0


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
def test_mxfp8_fp8_parameter_main_grad_sink_gets_the_weight_gradient(segments):
    x, dy = _data(segments, torch.float32)
    plain = _layer(fp8_param=True)
    want = _run(plain, x, dy, segments, grouped=True)
    fused = _layer(fp8_param=True)
    sink = BufferSink([fused.weight])
    fused.weight.main_grad_sink = sink
    got = _run(fused, x, dy, segments, grouped=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] is None and sink.written == [id(fused.weight)]
    assert torch.equal(sink.grad(fused.weight), want[2])
    _run(fused, x, dy, segments, grouped=True)  # a second micro-batch adds to the slot
    assert torch.equal(sink.grad(fused.weight), want[2] + want[2])


def test_a_bf16_fp8_parameter_sink_gets_the_fp32_product():
    """fuse_into_main_grad's rule: dW made in the buffer's dtype (fp32), so rounding it to bf16
    gives the unfused bf16 grad where each expert has one segment, and the sink kept more."""
    x, dy = _data(SEGMENTS, torch.bfloat16)
    want = _run(_layer(torch.bfloat16, fp8_param=True), x, dy, SEGMENTS, grouped=True)
    fused = _layer(torch.bfloat16, fp8_param=True)
    sink = BufferSink([fused.weight])
    fused.weight.main_grad_sink = sink
    _run(fused, x, dy, SEGMENTS, grouped=True)
    got = sink.grad(fused.weight)
    assert got.dtype == torch.float32 and torch.equal(got.to(torch.bfloat16), want[2])
    assert not torch.equal(got, want[2].float())


def test_token_columnwise_copy_equals_quantizing_each_segment_alone():
    config = _config()
    sizes = [40, 0, 24, 33, 3]
    x, _ = _data([sizes], torch.float32)
    position, padded_sizes = grouped_mxfp8._padded_positions(sizes, x.shape[0], 32, x.device)
    padded = grouped_operands.padded_copy(x, position, sum(padded_sizes))
    assert padded_sizes == [64, 0, 32, 64, 32] and padded.shape == (192, IN)
    _, col = grouped_mxfp8._token_values(
        padded, config, "input", torch.float32, rowwise=False, columnwise=True
    )
    start, padded_start = 0, 0
    for size, padded_size in zip(sizes, padded_sizes):
        if size:
            piece = x[start : start + size]
            _, alone = grouped_mxfp8._token_values(
                piece, config, "input", torch.float32, rowwise=False, columnwise=True
            )
            assert torch.equal(col[:, padded_start : padded_start + size], alone)
        start, padded_start = start + size, padded_start + padded_size


def test_an_output_dim_not_a_multiple_of_32_keeps_the_per_segment_path(monkeypatch):
    calls = _counting(monkeypatch)
    layer = _layer(out=48)
    x, dy = _data(SEGMENTS, torch.float32, out=48)
    y, _, dw = _run(layer, x, dy, SEGMENTS, grouped=True)
    assert calls == [] and y.shape == (x.shape[0], 48) and dw.abs().max() > 0
    spec = _config().spec
    assert not grouped_mxfp8.applies(spec, layer.weight) and grouped_mxfp8.applies(
        spec, _layer().weight
    )


def test_a_compiled_caller_runs_the_mxfp8_call_outside_its_graph(monkeypatch):
    calls = _counting(monkeypatch)
    layer = _layer()
    x, dy = _data(SEGMENTS, torch.float32)
    want = _run(layer, x, dy, SEGMENTS, grouped=True)
    counts = torch.tensor([sum(c) for c in SEGMENTS])
    assert not layer.takes_device_counts(x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t, counts), backend="aot_eager")
    tokens = x.clone().requires_grad_()
    layer.weight.grad = None
    y = compiled(tokens)
    y.backward(dy)
    assert calls == [1, 1]
    assert torch.equal(y, want[0]) and torch.equal(tokens.grad, want[1])
    assert torch.equal(layer.weight.grad, want[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS, [[256], [0], [512], [192]]])
@pytest.mark.parametrize("fp8_param", [False, True])
def test_cuda_grouped_mxfp8_equals_the_per_segment_path_within_bf16_rounding(segments, fp8_param):
    layer = _layer(torch.bfloat16, fp8_param=fp8_param, device="cuda")
    x, dy = _data(segments, torch.bfloat16, device="cuda")
    want = _run(layer, x, dy, segments, grouped=False)
    got = _run(layer, x, dy, segments, grouped=True)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        # bf16 roundings of the largest value: an output's, or (several segments of one
        # expert) the per-segment path's rounded products and their bf16 sum.
        bound = 2.0**-6 * b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= bound
    empty = [e for e, counts in enumerate(segments) if sum(counts) == 0]
    assert all(got[2][e].abs().max() == 0 for e in empty)
    assert fp8_experts.grouped_path_applies(layer.fp8_config, layer.weight)
