"""The one-function FP8 grouped GEMM of the experts (moe/grouped_fp8.py) against the per-segment
reference path of Fp8StackedLinear (fp8_experts.grouped_fp8_gemm), tensorwise on a
high-precision weight (blockwise and FP8 parameters: test_grouped_fp8_blockwise_params.py).

CPU: bitwise equal (torch.equal) in forward, input gradient and weight gradient, for fp32 and
bf16 tokens, each fp8 format and power-of-2 scales, on ragged segments with empty experts and
empty segments, and with three segments of one expert (the weight gradient sums them last
segment first, as autograd sums the reference's per-segment contributions). It compiles with
fullgraph=True. mxfp8 at this output dim (48, not a multiple of its 32-row cell) takes the
reference path (asserted; its grouped path: test_grouped_mxfp8.py; delayed's:
test_grouped_fp8_delayed.py). The CUDA fallbacks' scale layouts are checked on CPU through
grouped_gemm.py's kernel emulation.
GPU (H200): torch._scaled_grouped_mm and the Triton kernels equal the CPU emulation within the
fast-accumulation bound, 2e-3 of the output's max|.| (measured ~4e-4 on the H200)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.moe import grouped_emulation, grouped_fp8, grouped_operands
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear

EXPERTS, IN, OUT = 4, 64, 48
SEGMENTS = [[40, 24], [0, 0], [0, 56], [30, 3]]  # expert 1 empty, empty segments
FAST_ACCUM_BOUND = 2e-3


def _layer(recipe="tensorwise", fp8_format="hybrid", dtype=torch.float32, pow2=None, device="cpu"):
    config = Fp8Config(recipe=recipe, fp8_format=fp8_format, power_2_scale=pow2)
    layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1.0, 3.0, 300.0, 0.004]).view(EXPERTS, 1, 1)
    with torch.no_grad():
        weight = torch.randn(EXPERTS, OUT, IN, generator=generator) * magnitudes / 8
        layer.weight.copy_(weight.to(dtype))
    return layer


def _data(segments, dtype, device="cpu"):
    rows = sum(sum(c) for c in segments)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, IN, generator=generator) * torch.linspace(0.01, 40, rows)[:, None]
    dy = torch.randn(rows, OUT, generator=generator)
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def _run(layer, x, dy, segments, grouped, *, on_device=False):
    """(y, dx, dW) of layer on segments; on_device (one segment per expert): the token counts
    handed over as a tensor on x's device, as the dispatcher hands them at EP 1 (a device
    name: on that device)."""
    layer.grouped = grouped
    layer.weight.grad = None
    x = x.detach().clone().requires_grad_()
    counts = [sum(c) for c in segments]
    if on_device:
        device = x.device if on_device is True else on_device
        y = layer(x, torch.tensor(counts, device=device))
    else:
        y = layer(x, counts, segments)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("pow2", [False, True])
def test_grouped_function_equals_the_per_segment_path_bitwise(dtype, fp8_format, pow2):
    layer = _layer(fp8_format=fp8_format, dtype=dtype, pow2=pow2)
    x, dy = _data(SEGMENTS, dtype)
    want = _run(layer, x, dy, SEGMENTS, grouped=False)
    got = _run(layer, x, dy, SEGMENTS, grouped=True)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert want[0].abs().max() > 1.0 and want[2][1].abs().max() == 0  # expert 1 got no rows


def test_three_segments_of_one_expert_are_summed_in_the_reference_order():
    segments = [[20, 17, 9], [5], [0], [11, 0, 2]]
    layer = _layer()
    x, dy = _data(segments, torch.float32)
    want = _run(layer, x, dy, segments, grouped=False)
    got = _run(layer, x, dy, segments, grouped=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("recipe", ["mxfp8"])
def test_other_recipes_take_the_per_segment_path(recipe, monkeypatch):
    """mxfp8 where an expert's 32x1 cells would span two experts (OUT 48)."""
    calls = []
    monkeypatch.setattr(
        "megatron.core.transformer.moe.fp8_experts.grouped_fp8_linear",
        lambda *args, **kwargs: calls.append(args),
    )
    layer = _layer(recipe)
    x, dy = _data(SEGMENTS, torch.float32)
    y, _, _ = _run(layer, x, dy, SEGMENTS, grouped=True)
    assert calls == [] and y.shape == (x.shape[0], OUT)


def test_segment_quantization_equals_quantizing_each_segment_alone():
    sizes = [7, 0, 33, 1]
    x = torch.randn(sum(sizes), IN) * 5
    ids = grouped_operands.segment_ids(torch.tensor(sizes), x.shape[0])
    data, scale_inv = grouped_operands.quantize_segments(
        x, ids, len(sizes), fp8_dtype=torch.float8_e4m3fn, power_2_scale=False
    )
    start = 0
    for s, size in enumerate(sizes):
        if size:
            piece = x[start : start + size]
            q = quantize(piece, recipe="tensorwise", fp8_dtype=torch.float8_e4m3fn, role="input")
            got_bytes = data[start : start + size].view(torch.uint8)
            assert torch.equal(got_bytes, q.rowwise_data.view(torch.uint8))
            assert torch.equal(scale_inv[s], q.rowwise_scale_inv.reshape(()))
        start += size
    assert scale_inv[1] == 1.0


def test_segment_amax_per_tile_equals_the_per_row_scatter():
    """The tiled reduction (rows laid out in each segment's whole 128-row tiles, reduced per
    tile, one scatter per tile) gives every segment's amax as the scatter of every row does,
    with empty segments, a segment of exactly one tile and padding tiles past the last."""
    sizes = torch.tensor([7, 0, 128, 129, 1, 0])
    rows = int(sizes.sum())
    ids = grouped_operands.segment_ids(sizes, rows)
    row_amax = torch.rand(rows) * 10
    row_amax[263] = 50.0  # the largest of segment 3: its last row, alone in its second tile
    row_amax[0] = 99.0  # padding that read row 0 would carry it into other segments
    plain = grouped_operands.segment_amax(row_amax, ids, 6)
    length = grouped_operands.padded_rows(sizes, rows, 128)  # the bound, past the real tiles
    position = grouped_operands.padded_positions(ids, sizes, 128)
    source = grouped_operands.padded_sources(position, length)
    tiled = grouped_operands.segment_amax(row_amax, ids, 6, (source, 128))
    assert torch.equal(tiled, plain)
    assert tiled[1] == 0 and tiled[5] == 0 and tiled[3] == 50.0 and tiled[0] == 99.0
    assert tiled[1:].max() < 99.0
    want = [row_amax[a:b].max().item() if b > a else 0.0 for a, b in ((0, 7), (7, 7),
            (7, 135), (135, 264), (264, 265), (265, 265))]  # fmt: skip
    assert tiled.tolist() == want


def test_device_counts_that_do_not_sum_to_the_tokens_are_refused():
    """Counts read on the device are checked there (torch._assert_async, no host sync)."""
    layer = _layer()
    x, _ = _data(SEGMENTS, torch.float32)
    with pytest.raises(RuntimeError, match="token counts do not sum to the tokens"):
        layer(x, torch.tensor([50, 0, 40, 5]))


def test_padded_transpose_puts_each_segment_at_a_whole_tile():
    """The tensorwise weight gradient's operand: bytes [M, C] transposed with each segment
    starting at a multiple of 128 tokens (segments of 7, 0, 130 and 1 rows start at columns
    0, 128, 128 and 384; 640 columns, the most 4 segments of 138 rows can need), zeros
    elsewhere."""
    sizes = torch.tensor([7, 0, 130, 1])
    data = (torch.arange(138 * 3) % 250 + 1).to(torch.uint8).view(138, 3)
    data = data.view(torch.float8_e4m3fn)
    ids = grouped_operands.segment_ids(sizes, 138)
    position = grouped_operands.padded_positions(ids, sizes, 128)
    length = grouped_operands.padded_rows(sizes, 138, 128)
    source = grouped_operands.padded_sources(position, length)
    assert torch.equal(source[position], torch.arange(138, dtype=torch.int32))
    assert int((source >= 0).sum()) == 138 and source.shape == (640,)
    got = grouped_operands.padded_transpose(data, source).view(torch.uint8)
    raw = data.view(torch.uint8)
    assert got.shape == (3, 640) and got.dtype == torch.uint8
    for at, rows in ((0, slice(0, 7)), (128, slice(7, 137)), (384, slice(137, 138))):
        width = rows.stop - rows.start
        assert torch.equal(got[:, at : at + width], raw[rows].t())
    kept = 7 + 130 + 1
    assert int(got.count_nonzero()) == 3 * kept  # nothing else but zeros


def test_grouped_function_compiles_without_graph_breaks():
    layer = _layer()
    x, dy = _data(SEGMENTS, torch.float32)
    counts = [sum(c) for c in SEGMENTS]
    want = _run(layer, x, dy, SEGMENTS, grouped=True)

    def step(tokens):
        return layer(tokens, counts, SEGMENTS)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    layer.weight.grad = None
    tokens = x.detach().clone().requires_grad_()
    y = compiled(tokens)
    y.backward(dy)
    assert torch.equal(y, want[0]) and torch.equal(tokens.grad, want[1])
    assert torch.equal(layer.weight.grad, want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_paths_equal_the_emulation_within_the_fast_accumulation_bound(
    fp8_format, dtype
):
    """bf16 + e4m3: torch._scaled_grouped_mm forward and dgrad; hybrid (E5M2 grads) and fp32:
    the Triton kernels; wgrad: the Triton ragged-K kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the CPU emulation is the reference)")
    segments = [[200, 64], [0, 0], [0, 130], [96, 3]]
    layer = _layer(fp8_format=fp8_format, dtype=dtype, device="cuda")
    x, dy = _data(segments, dtype, device="cuda")
    got = _run(layer, x, dy, segments, grouped=True)
    cpu = _layer(fp8_format=fp8_format, dtype=dtype)
    cpu.weight.data.copy_(layer.weight.data.cpu())
    want = _run(cpu, x.cpu(), dy.cpu(), segments, grouped=True)
    for a, b in zip(got, want):
        a, b = a.float().cpu(), b.float()
        bound = FAST_ACCUM_BOUND * b.abs().max().item()
        rounding = 2**-7 if dtype == torch.bfloat16 else 0.0  # one bf16 rounding of the output
        torch.testing.assert_close(a, b, rtol=rounding, atol=bound)


@pytest.mark.parametrize("segments", [SEGMENTS, [[64], [0], [56], [33]]])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cuda_dispatch_scale_layouts_on_the_emulated_kernels(grad_dtype, segments):
    """The CUDA fallbacks' operand and scale layouts (each row's segment scale, applied by
    the ragged-M kernel to its fp32 sum; the ragged-K kernel over segments with unit scales,
    then scaled and summed per expert, or with one segment per expert its per-group scales
    and dW written directly), run here through grouped_gemm.py's emulation of those kernels:
    equal to the per-segment emulation up to fp32 rounding (the scales multiply in another
    order)."""
    sizes = [c for counts in segments for c in counts]
    owner = [e for e, counts in enumerate(segments) for _ in counts]
    k, n = 256, 160  # two K blocks, N not a multiple of 128
    generator = torch.Generator().manual_seed(2)
    x = (
        torch.randn(sum(sizes), k, generator=generator)
        * torch.linspace(0.1, 9, sum(sizes))[:, None]
    )
    w = (
        torch.randn(EXPERTS, n, k, generator=generator)
        * torch.tensor([1, 2, 30, 0.1])[:, None, None]
    )
    ids = grouped_operands.segment_ids(torch.tensor(sizes), x.shape[0])
    x_q, x_s = grouped_operands.quantize_segments(
        x, ids, len(sizes), fp8_dtype=grad_dtype, power_2_scale=False
    )
    w_q, w_s = grouped_operands.quantize_experts(
        w, spec=recipe_spec("tensorwise"), fp8_dtype=torch.float8_e4m3fn, power_2_scale=False
    )
    # grouped_fp8_mm takes one A scale_inv per row (its segment's)
    args = (x_q, x_s[ids], w_q, w_s, torch.tensor(sizes), owner, "tensorwise", torch.float32)
    want = grouped_emulation.emulated_mm(*args)
    got = grouped_fp8._cuda_mm(*args, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    dy = torch.randn(sum(sizes), n, generator=generator)
    dy_q, dy_s = grouped_operands.quantize_segments(
        dy, ids, len(sizes), fp8_dtype=grad_dtype, power_2_scale=False
    )
    x_q, x_s = grouped_operands.quantize_segments(
        x, ids, len(sizes), fp8_dtype=torch.float8_e4m3fn, power_2_scale=False
    )
    out = torch.zeros(EXPERTS, n, k)
    wargs = (dy_q, dy_s, x_q, x_s, torch.tensor(sizes), owner, "tensorwise")
    want = grouped_emulation.emulated_wgrad(*wargs, out.clone())
    padded = grouped_operands.padded_rows(sizes, sum(sizes), 128)  # host sizes: exact
    got = grouped_fp8._cuda_wgrad(*wargs, out.shape, out.dtype, padded)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert want[1].abs().max() == 0 and want[2].abs().max() > 0
