"""The experts' one grouped FP8 function (moe/grouped_fp8.py) under blockwise and on FP8 expert
parameters (the stacked QuantizedTensor Megatron-FSDP keeps under --fp8-param-gather), against
the per-segment reference path of Fp8StackedLinear (fp8_experts.grouped_fp8_gemm).

CPU: bitwise equal (torch.equal) in forward, input gradient and weight gradient: blockwise on
a high-precision weight for fp32 and bf16 tokens, each fp8 format and scale rounding; FP8
parameters under tensorwise and blockwise; ragged segments longer than 128 rows and not
multiples of it, an expert without rows, empty segments, several segments of one expert (EP),
K and N not multiples of 128. The operands equal quantizing each piece alone (the 128x1 cells
of the weight gradient counted from each segment's start), an FP8 parameter's backward reads
the bytes the engine re-gathered (as `ExpertWeight` does), and the function compiles with
fullgraph=True on FP8 parameters. The CUDA dispatch's blockwise scale layouts run on CPU
through grouped_gemm.py's kernel emulation. GPU (H200): the Triton kernels (and
torch._scaled_grouped_mm) equal the CPU emulation within 1e-3 of the output's max|.| where
they accumulate precisely (blockwise) and 2e-3 with fast accumulation (tensorwise)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.formats import fp8_dtype_for_role
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.moe import (
    fp8_experts,
    grouped_emulation,
    grouped_fp8,
    grouped_operands,
)
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from tests.unit_tests.models.moe.test_grouped_fp8 import _run

EXPERTS, IN, OUT = 4, 200, 144  # K and N not multiples of 128: short last cells
SEGMENTS = [[130, 24], [0, 0], [0, 300], [40, 3]]  # > 128 rows, expert 1 empty, empty segments
EP_SEGMENTS = [[20, 129, 9], [5], [0], [256, 0, 2]]  # several segments of one expert
BOUND = {"tensorwise": 2e-3, "blockwise": 1e-3}  # fast / precise accumulation, of max|.|


def _config(recipe, fp8_format="hybrid", pow2=None) -> Fp8Config:
    return Fp8Config(recipe=recipe, fp8_format=fp8_format, power_2_scale=pow2)


def _fp8_parameter(weight: torch.Tensor, config: Fp8Config) -> torch.nn.Parameter:
    """The stacked FP8 parameter as the engine holds it: each expert quantized alone, its
    bytes and scales stacked along a leading expert dim."""
    fp8_dtype = fp8_dtype_for_role(config.fp8_format, "weight")
    parts = [
        quantize(
            weight[e],
            recipe=config.recipe,
            fp8_dtype=fp8_dtype,
            role="weight",
            power_2_scale=config.quantize_power_2_scale,
            backend="reference",
        )
        for e in range(weight.shape[0])
    ]
    stacked = QuantizedTensor(
        shape=weight.shape,
        dtype=weight.dtype,
        recipe=config.recipe,
        fp8_dtype=fp8_dtype,
        role="weight",
        rowwise_data=torch.stack([p.rowwise_data for p in parts]),
        rowwise_scale_inv=torch.stack([p.rowwise_scale_inv for p in parts]),
    )
    return torch.nn.Parameter(stacked)


def _layer(recipe, *, dtype=torch.float32, fp8_param=False, device="cpu", **options):
    config = _config(recipe, **options)
    layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1.0, 3.0, 300.0, 0.004]).view(EXPERTS, 1, 1)
    weight = torch.randn(EXPERTS, OUT, IN, generator=generator) * magnitudes / 8
    weight[0, :, 130:] *= 50  # another magnitude in the second 128x128 cell column
    with torch.no_grad():
        layer.weight.copy_(weight.to(dtype))
    if fp8_param:
        layer.weight = _fp8_parameter(layer.weight.detach(), config)
    return layer


def _data(segments, dtype, device="cpu"):
    rows = sum(sum(c) for c in segments)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, IN, generator=generator) * torch.linspace(0.01, 40, rows)[:, None]
    dy = torch.randn(rows, OUT, generator=generator) * torch.linspace(3, 0.02, rows)[:, None]
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def _assert_bitwise(got, want, segments):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    wgrad_max = [want[2][e].abs().max() for e in range(EXPERTS)]
    assert [m > 0 for m in wgrad_max] == [sum(counts) > 0 for counts in segments]
    assert want[0].abs().max() > 1.0


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fp8_format", "pow2"), [("hybrid", None), ("e4m3", False)])
def test_blockwise_grouped_function_equals_the_per_segment_path_bitwise(
    segments, dtype, fp8_format, pow2
):
    layer = _layer("blockwise", dtype=dtype, fp8_format=fp8_format, pow2=pow2)
    x, dy = _data(segments, dtype)
    want = _run(layer, x, dy, segments, grouped=False)
    got = _run(layer, x, dy, segments, grouped=True)
    _assert_bitwise(got, want, segments)


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_parameters_take_the_grouped_function_bitwise_the_per_segment_path(
    recipe, dtype, segments, monkeypatch
):
    layer = _layer(recipe, dtype=dtype, fp8_param=True)
    assert isinstance(layer.weight, QuantizedTensor)
    x, dy = _data(segments, dtype)
    want = _run(layer, x, dy, segments, grouped=False)
    calls = []
    real = fp8_experts.grouped_fp8_linear
    monkeypatch.setattr(
        fp8_experts, "grouped_fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = _run(layer, x, dy, segments, grouped=True)
    assert calls == [1]
    _assert_bitwise(got, want, segments)
    assert got[2].shape == layer.weight.shape and got[2].dtype == dtype


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_parameter_backward_reads_the_bytes_gathered_for_it(recipe):
    """The engine releases the weight's bytes after the forward and gathers them again for the
    backward: the data gradient reads the bytes then present, as the per-segment path's
    `ExpertWeight` does (here -2 x the weight: the same bytes negated, half the scale)."""
    x, dy = _data(SEGMENTS, torch.float32)
    counts = [sum(c) for c in SEGMENTS]
    grads = []
    for grouped in (False, True):
        layer = _layer(recipe, fp8_param=True)
        layer.grouped = grouped
        plain = _layer(recipe).weight.detach()
        regathered = _fp8_parameter(plain * -2, layer.fp8_config)
        tokens = x.clone().requires_grad_()
        y = layer(tokens, counts, SEGMENTS)
        layer.weight.rowwise_data = None  # released after the forward
        layer.weight.rowwise_data = regathered.rowwise_data.clone()
        layer.weight.rowwise_scale_inv.copy_(regathered.rowwise_scale_inv)
        y.backward(dy)
        grads.append(tokens.grad)
    unchanged = _run(_layer(recipe, fp8_param=True), x, dy, SEGMENTS, grouped=True)[1]
    assert torch.equal(grads[1], grads[0])
    assert torch.equal(grads[1], -2 * unchanged) and unchanged.abs().max() > 0


def test_gathered_rows_keep_an_outer_dim_major_scale_grid():
    """The rows' 1x128 scales gathered from the padded copy keep the fused quantizers'
    [K/128, M] order (the grouped GEMM reads a row tile's scales of one K block in one load);
    a row-major grid stays row-major; the values are grid[index] either way."""
    grid = torch.rand(2, 9).t()  # [9 rows, 2 cells], outer-dim-major
    index = torch.tensor([4, 0, 8, 3])
    got = grouped_operands._rows_of_grid(grid, index)
    assert torch.equal(got, grid[index]) and got.stride() == (1, 4)
    row_major = grid.contiguous()
    got = grouped_operands._rows_of_grid(row_major, index)
    assert torch.equal(got, grid[index]) and got.stride() == (2, 1)


def test_blockwise_operands_equal_quantizing_each_piece_alone():
    """Rows in 1x128 cells (all at once), each segment's 128x1 columnwise cells counted from its
    own first row (kept transposed, each segment padded to whole cells), each expert's 128x128
    cells: the bytes and scales of `quantize` on the piece (what the per-segment path's
    Fp8Linear quantizes)."""
    spec, fp8 = recipe_spec("blockwise"), torch.float8_e4m3fn
    sizes = [130, 0, 7, 256, 1]
    x = torch.randn(sum(sizes), IN) * torch.linspace(0.1, 30, sum(sizes))[:, None]
    sizes_t = torch.tensor(sizes)
    ids = grouped_operands.segment_ids(sizes_t, x.shape[0])
    options = dict(spec=spec, fp8_dtype=fp8, power_2_scale=True)
    alone = grouped_operands.quantize_rows(x, role="input", **options)
    length = grouped_operands.padded_rows(sizes_t, sum(sizes), 128)  # the device bound
    (rows, rows_scale), (cols_t, cols_scale_t) = grouped_operands.quantize_segment_operands(
        x, ids, sizes_t, role="input", length=length, **options
    )
    assert torch.equal(rows.view(torch.uint8), alone[0].view(torch.uint8))
    assert torch.equal(rows_scale, alone[1]) and rows_scale.shape == (sum(sizes), 2)
    starts = grouped_operands.bounds(sizes)
    chunks = grouped_operands.chunk_bounds(sizes, spec.block)
    assert chunks == [0, 2, 2, 3, 5, 6]
    # The copy has the rows that any 5 sizes summing to 394 can need, (394 + 5 * 127) // 128
    # = 8 cells (sizes on the device): 2 cells past these sizes' 6, zeros; host sizes: 6.
    assert cols_t.shape == (IN, 8 * 128) and cols_scale_t.shape == (IN, 8)
    assert grouped_operands.padded_rows(sizes, sum(sizes), 128) == 6 * 128
    assert cols_t[:, 6 * 128 :].float().abs().sum() == 0
    for s in (0, 2, 3, 4):
        piece = x[starts[s] : starts[s + 1]]
        q = quantize(piece, recipe="blockwise", fp8_dtype=fp8, role="input", columnwise=True)
        assert torch.equal(rows[starts[s] : starts[s + 1]].view(torch.uint8), q.rowwise_data)
        assert torch.equal(rows_scale[starts[s] : starts[s + 1]], q.rowwise_scale_inv)
        at = 128 * chunks[s]
        got_t = cols_t[:, at : at + sizes[s]].view(torch.uint8)
        assert torch.equal(got_t, q.columnwise_data.t())
        assert cols_t[:, at + sizes[s] : 128 * chunks[s + 1]].float().abs().sum() == 0
        assert torch.equal(cols_scale_t[:, chunks[s] : chunks[s + 1]], q.columnwise_scale_inv.t())
    weight = _layer("blockwise").weight.detach()
    data, scale = grouped_operands.quantize_experts(
        weight, spec=spec, fp8_dtype=fp8, power_2_scale=True
    )
    assert scale.shape == (EXPERTS, 2, 2)
    for e in range(EXPERTS):
        q = quantize(weight[e], recipe="blockwise", fp8_dtype=fp8, role="weight")
        assert torch.equal(data[e].view(torch.uint8), q.rowwise_data)
        assert torch.equal(scale[e], q.rowwise_scale_inv)


@pytest.mark.parametrize("segments", [EP_SEGMENTS, [[158], [5], [0], [258]]])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_blockwise_cuda_dispatch_layouts_on_the_emulated_kernels(grad_dtype, segments):
    """The CUDA dispatch's blockwise operands (the ragged-M kernel's 1x128 / 128x128 scales, the
    ragged-K kernel over segments with the columnwise scales transposed to [N, C] / [K, C],
    results summed per expert, or written directly with one segment per expert), run here
    through grouped_gemm.py's emulation of the kernels:
    equal to the per-segment emulation up to fp32 rounding (other summation order)."""
    spec = recipe_spec("blockwise")
    sizes = [c for counts in segments for c in counts]
    owner = [e for e, counts in enumerate(segments) for _ in counts]
    layer = _layer("blockwise")
    x, dy = _data(segments, torch.float32)
    sizes = torch.tensor(sizes)
    ids = grouped_operands.segment_ids(sizes, x.shape[0])
    length = grouped_operands.padded_rows(sizes, x.shape[0], 128)
    options = dict(spec=spec, power_2_scale=True, length=length)
    x_row, x_col = grouped_operands.quantize_segment_operands(
        x, ids, sizes, role="input", fp8_dtype=torch.float8_e4m3fn, **options
    )
    w_row = grouped_operands.quantize_experts(
        layer.weight.detach(), fp8_dtype=torch.float8_e4m3fn, spec=spec, power_2_scale=True
    )
    dy_row, dy_col = grouped_operands.quantize_segment_operands(
        dy, ids, sizes, role="grad", fp8_dtype=grad_dtype, **options
    )
    w_t = grouped_operands.transposed_experts(*w_row)
    for a, b in ((x_row, w_row), (dy_row, w_t)):
        args = (*a, *b, sizes, owner, "blockwise", torch.float32)
        want = grouped_emulation.emulated_mm(*args)
        got = grouped_fp8._cuda_mm(*args, False)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    wargs = (*dy_col, *x_col, sizes, owner, "blockwise")
    out = torch.zeros(EXPERTS, OUT, IN)
    assert dy_col[0].shape[0] == OUT and x_col[0].shape[0] == IN  # transposed, padded
    want = grouped_emulation.emulated_wgrad(*wargs, out.clone())
    got = grouped_fp8._cuda_wgrad(*wargs, out.shape, out.dtype, length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert want[2].abs().max() == 0 and want[3].abs().max() > 0


def _assert_close_to_emulation(got, want, bound: float, dtype: torch.dtype, segments) -> None:
    """(y, dx, dW) within bound of max|.|. In bf16 the outputs carry one bf16 rounding each
    (rtol 2^-7), and the emulated dW rounds each segment's fp32 partial to bf16 before adding
    it to its expert (the per-segment path's order) where the kernel sums in fp32 and rounds
    once: up to half a bf16 ulp of each partial, which cancellation can leave larger than the
    sum (on an H100: 1.72 on an element of 5.75, partials ~1,600), so dW also allows 2^-8 of
    max|dW| per segment of the expert with the most."""
    most = max(len(counts) for counts in segments)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = a.float().cpu(), b.float()
        rounding = 2**-7 if dtype == torch.bfloat16 else 0.0  # one bf16 rounding of the output
        partials = most * 2**-8 if dtype == torch.bfloat16 and i == 2 else 0.0
        atol = (bound + partials) * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=rounding, atol=atol)


DEVICE_SEGMENTS = [[154], [0], [300], [43]]
"""One segment per expert, its counts handed over on the device (EP 1)."""


@pytest.mark.gpu
@pytest.mark.parametrize("segments", ["ep", "device", "cpu-counts"])
@pytest.mark.parametrize("fp8_param", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_blockwise_and_fp8_parameter_paths_equal_the_emulation(
    recipe, fp8_param, fp8_format, dtype, segments
):
    """Blockwise: the ragged-M kernel's blockwise mode (forward, dgrad) and the ragged-K
    kernel's (wgrad, 128-token chunks from each segment's start), precise accumulation.
    FP8 parameters: the grouped paths on the gathered bytes (tensorwise: fast accumulation in
    the forward). Ragged segments of several lengths, K=200 and N=144 (short last cells);
    "device": token counts on the GPU (the kernels' schedules and torch's offsets built
    there), against the CPU emulation with host counts; "cpu-counts": a counts tensor on the
    CPU, moved to the tokens' device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the CPU emulation is the reference)")
    on_device = {"ep": False, "device": True, "cpu-counts": "cpu"}[segments]
    segments = DEVICE_SEGMENTS if on_device else EP_SEGMENTS
    options = dict(dtype=dtype, fp8_param=fp8_param, fp8_format=fp8_format)
    layer = _layer(recipe, device="cuda", **options)
    x, dy = _data(segments, dtype, device="cuda")
    got = _run(layer, x, dy, segments, grouped=True, on_device=on_device)
    want = _run(_layer(recipe, **options), x.cpu(), dy.cpu(), segments, grouped=True)
    _assert_close_to_emulation(got, want, BOUND[recipe], dtype, segments)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_grouped_function_on_fp8_parameters_compiles_without_graph_breaks(recipe):
    """As the training compiles a layer (its forward compiled, `prepare_for_compile`'s hooks
    eager around it): the FP8 parameter enters the graph as its stand-in, the GEMMs that read
    it are megatron_fp8::grouped_fp8_weight_mm, and its grad reaches the parameter; bitwise
    the eager grouped function."""
    layer = _layer(recipe, fp8_param=True)
    x, dy = _data(EP_SEGMENTS, torch.float32)
    counts = [sum(c) for c in EP_SEGMENTS]
    want = _run(layer, x, dy, EP_SEGMENTS, grouped=True)
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    prepare_for_compile(layer)
    for _ in range(2):  # the second call reuses the graph and the stand-in
        layer.weight.grad = None
        tokens = x.clone().requires_grad_()
        y = layer(tokens, counts, EP_SEGMENTS)
        y.backward(dy)
        _assert_bitwise((y.detach(), tokens.grad, layer.weight.grad), want, EP_SEGMENTS)
    assert isinstance(layer.weight, QuantizedTensor) and layer._weight_stand_in is not None


@pytest.mark.parametrize("fp8_param", [False, True], ids=["weight", "fp8-param"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_token_counts_on_the_device_compile_into_one_graph(recipe, fp8_param):
    """Tokens per expert as a tensor on the tokens' device (the dispatcher's at EP 1): the
    grouped function reads them there, so the layer compiles with fullgraph=True into one
    graph that other counts reuse (no recompile); forward, input and weight gradients are
    bitwise those of host counts. (Host counts from .tolist() were a graph break.)"""
    from torch._dynamo.utils import counters

    eager, layer = _layer(recipe, fp8_param=fp8_param), _layer(recipe, fp8_param=fp8_param)
    torch._dynamo.reset()
    counters.clear()
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    prepare_for_compile(layer)
    for segments in (DEVICE_SEGMENTS, [[2], [290], [200], [5]]):  # 497 rows each
        x, dy = _data(segments, torch.float32)
        want = _run(eager, x, dy, segments, grouped=True)  # host counts, eager
        got = _run(layer, x, dy, segments, grouped=True, on_device=True)
        _assert_bitwise(got, want, segments)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
