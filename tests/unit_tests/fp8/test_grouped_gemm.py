"""The FP8 grouped GEMMs of the MoE experts (fp8/cuda/grouped_gemm.py).

CPU: the emulated path (one exact emulated GEMM per group) equals a float64 product of the
operands dequantized in the test, group by group, for each recipe; empty groups give empty
rows (forward) or zero blocks (weight gradient); mismatched shapes are refused.
The weight gradient also under blockwise (1x128 cells along each group's tokens).
GPU (H200): the Triton kernels equal the emulated path up to fp32 accumulation order, on ragged
group sizes (0, < 128, not multiples of 128) and N, K not multiples of 128."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.cuda import grouped_gemm
from megatron.core.fp8.cuda.grouped_gemm import (
    BLOCK_K,
    BLOCK_M,
    group_offsets,
    grouped_scaled_mm,
    grouped_scaled_mm_wgrad,
    tile_schedule,
    transpose_bytes,
)
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.recipe import recipe_spec

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [70, 0, 150, 3]
M, N, K = sum(SIZES), 160, 256


def _quantized(x, recipe, role, fp8_dtype=E4M3):
    # delayed quantizes with a scale from earlier steps' amaxes: any fixed one here.
    scale = torch.tensor(64.0, device=x.device) if recipe == "delayed" else None
    q = quantize(x, recipe=recipe, fp8_dtype=fp8_dtype, role=role, scale=scale)
    return q.rowwise_data.view(fp8_dtype), q.rowwise_scale_inv, q.dequantize().double()


def _weights(recipe, device="cpu"):
    """Per-group weights quantized one group at a time, stacked: data [G, N, K], scales, and the
    dequantized values."""
    torch.manual_seed(1)
    parts = [_quantized(torch.randn(N, K, device=device) * 0.05, recipe, "weight") for _ in SIZES]
    data = torch.stack([p[0] for p in parts])
    scale = torch.stack([p[1] for p in parts])
    if scale.dim() == 1 or scale[0].numel() == 1:
        scale = scale.reshape(len(SIZES))
    return data, scale, torch.stack([p[2] for p in parts])


def _columnwise_groups(t, role, fp8_dtype=E4M3):
    """t [M, X] quantized blockwise one group at a time with 128x1 cells along M (the grouped
    weight gradient's operand): data [X, M], scale_inv [X, C] (each group's cells in turn) and
    the dequantized values [X, M]."""
    data, scales, values = [], [], []
    for piece in t.split(SIZES):
        if piece.shape[0] == 0:
            data.append(piece.new_zeros(0, t.shape[1], dtype=torch.uint8))
            scales.append(piece.new_zeros(0, t.shape[1]))
            values.append(piece.new_zeros(t.shape[1], 0, dtype=torch.float64))
            continue
        q = quantize(piece, recipe="blockwise", fp8_dtype=fp8_dtype, role=role, columnwise=True)
        data.append(q.columnwise_data)
        scales.append(q.columnwise_scale_inv)
        values.append(q.gemm_operand("columnwise").dequantize().double())
    data_t = torch.cat(data).t().contiguous().view(fp8_dtype)
    return data_t, torch.cat(scales).t().contiguous(), torch.cat(values, dim=1)


def _offsets():
    out = [0]
    for size in SIZES:
        out.append(out[-1] + size)
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_emulated_grouped_forward_equals_the_dequantized_product(recipe) -> None:
    torch.manual_seed(0)
    a, a_scale, a_values = _quantized(torch.randn(M, K), recipe, "input")
    b, b_scale, b_values = _weights(recipe)
    out = grouped_scaled_mm(
        a, b, a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=SIZES, recipe=recipe,
        out_dtype=torch.float32,
    )  # fmt: skip
    offsets = _offsets()
    assert out.shape == (M, N) and out.dtype == torch.float32
    for g in range(len(SIZES)):
        rows = slice(offsets[g], offsets[g + 1])
        expected = a_values[rows] @ b_values[g].t()
        torch.testing.assert_close(out[rows].double(), expected, rtol=1e-5, atol=1e-5)
    assert out.abs().max() > 0.1


def _row_scaled_operands(device: str, k: int = K, a_dtype=E4M3):
    """A [M, k] FP8 with one scale_inv per row (each row's segment's), B [G, N, k] FP8 with one
    per group, and the fp64 product of their dequantized values."""
    a = (torch.randn(M, k, device=device) * 8).to(a_dtype)
    b = torch.randn(len(SIZES), N, k, device=device).to(E4M3)
    a_scale = torch.rand(M, device=device) + 0.5
    b_scale = torch.rand(len(SIZES), device=device) + 0.5
    want = torch.empty(M, N, dtype=torch.float64, device=device)
    offsets = _offsets()
    for g in range(len(SIZES)):
        rows = slice(offsets[g], offsets[g + 1])
        a_values = a[rows].double() * a_scale[rows, None].double()
        want[rows] = a_values @ (b[g].double() * b_scale[g].double()).t()
    return a, b, dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=SIZES), want


def test_emulated_grouped_forward_takes_one_per_tensor_scale_per_row() -> None:
    """Per-tensor A scales given per row ([M]: each row's segment's, as the experts' dgrad
    passes them) scale each row's product."""
    torch.manual_seed(0)
    a, b, kwargs, want = _row_scaled_operands("cpu")
    out = grouped_scaled_mm(a, b, **kwargs, recipe="tensorwise", out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_per_tensor_a_scale_is_a_scalar_or_one_per_row() -> None:
    """A [1] scale is the scalar it holds; any other length than the rows is refused."""
    torch.manual_seed(0)
    a, b, kwargs, _ = _row_scaled_operands("cpu")
    scalar = dict(kwargs, a_scale_inv=torch.tensor(0.5))
    one = dict(kwargs, a_scale_inv=torch.tensor([0.5]))
    want = grouped_scaled_mm(a, b, **scalar, recipe="tensorwise", out_dtype=torch.float32)
    got = grouped_scaled_mm(a, b, **one, recipe="tensorwise", out_dtype=torch.float32)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"a scalar or one per row \(223,\), got \(5,\)"):
        grouped_scaled_mm(
            a, b, **dict(kwargs, a_scale_inv=torch.ones(5)), recipe="tensorwise",
        )  # fmt: skip


def test_emulated_grouped_weight_gradient_equals_the_dequantized_product() -> None:
    torch.manual_seed(0)
    dy_t, dy_scale, dy_values = _quantized(torch.randn(N, M), "tensorwise", "grad", E5M2)
    x_t, x_scale, x_values = _quantized(torch.randn(K, M), "tensorwise", "input")
    out = grouped_scaled_mm_wgrad(
        dy_t, x_t, a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES,
        recipe="tensorwise",
    )  # fmt: skip
    offsets = _offsets()
    assert out.shape == (len(SIZES), N, K)
    for g in range(len(SIZES)):
        cols = slice(offsets[g], offsets[g + 1])
        expected = dy_values[:, cols] @ x_values[:, cols].t()
        torch.testing.assert_close(out[g].double(), expected, rtol=1e-5, atol=1e-4)
    assert out[1].abs().max() == 0.0  # the empty group


def _segments_quantized(t: torch.Tensor, role: str, fp8_dtype=E4M3, device="cpu"):
    """t [X, M] with each segment of SIZES (its tokens along M) quantized tensorwise on its own:
    bytes [X, M], scale_inv [S] (an empty segment's: 1), the dequantized values [X, M]."""
    data, scale, values = [], [], []
    for piece in t.split(SIZES, 1):
        if piece.shape[1] == 0:
            data.append(piece.to(torch.uint8))
            scale.append(torch.tensor(1.0))
            values.append(piece.double())
            continue
        piece_data, piece_scale, piece_values = _quantized(piece, "tensorwise", role, fp8_dtype)
        data.append(piece_data.view(torch.uint8))
        scale.append(piece_scale.reshape(()))
        values.append(piece_values)
    data_t = torch.cat(data, 1).view(fp8_dtype)
    return data_t.to(device), torch.stack(scale).to(device), torch.cat(values, 1)


SEGMENT_GROUP = [0, 0, 1, 1]
"""Segments of SIZES (70, 0, 150, 3 tokens) in 2 groups: an expert's rows from 2 EP ranks."""


def test_emulated_segmented_weight_gradient_sums_each_groups_segments() -> None:
    """segment_group: each group's dW is the sum of its segments' products, each segment with
    its own tensorwise scales (expert parallelism: an expert's rows from several ranks)."""
    torch.manual_seed(0)
    dy_t, dy_scale, dy_values = _segments_quantized(torch.randn(N, M) * 4, "grad", E5M2)
    x_t, x_scale, x_values = _segments_quantized(torch.randn(K, M), "input")
    assert len(set(dy_scale.tolist())) == 4  # each segment its own scale (the empty one: 1)
    out = grouped_scaled_mm_wgrad(
        dy_t, x_t, a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES,
        recipe="tensorwise", segment_group=SEGMENT_GROUP,
    )  # fmt: skip
    assert out.shape == (2, N, K)
    offsets = _offsets()
    for group, segments in ((0, (0, 1)), (1, (2, 3))):
        cols = slice(offsets[segments[0]], offsets[segments[1] + 1])
        expected = dy_values[:, cols] @ x_values[:, cols].t()
        torch.testing.assert_close(out[group].double(), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="whole_tiles: group sizes must be multiples of 128"):
        grouped_scaled_mm_wgrad(
            dy_t, x_t, a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES,
            recipe="tensorwise", whole_tiles=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="segment_group takes a per-tensor recipe"):
        grouped_scaled_mm_wgrad(
            dy_t, x_t, a_scale_inv=dy_scale[0], b_scale_inv=x_scale[0], group_sizes=SIZES,
            recipe="tensorwise", segment_group=SEGMENT_GROUP,
        )  # fmt: skip
    for bad in ([0, 1, 0, 1], [1, 1, 2, 2], [0, 0, 1]):  # out of order, no group 0, too short
        with pytest.raises(ValueError, match="segment_group"):
            grouped_scaled_mm_wgrad(
                dy_t, x_t, a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES,
                recipe="tensorwise", segment_group=bad,
            )  # fmt: skip


def test_emulated_blockwise_weight_gradient_equals_the_dequantized_product() -> None:
    """Blockwise: 1x128 cells along the tokens of each group, counted from its start (groups of
    70, 0, 150 and 3 tokens: 1, 0, 2 and 1 cells)."""
    torch.manual_seed(0)
    dy_t, dy_scale, dy_values = _columnwise_groups(torch.randn(M, N), "grad", E5M2)
    x_t, x_scale, x_values = _columnwise_groups(torch.randn(M, K) * 3, "input")
    assert dy_scale.shape == (N, 4) and x_scale.shape == (K, 4)
    out = grouped_scaled_mm_wgrad(
        dy_t, x_t, a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES,
        recipe="blockwise",
    )  # fmt: skip
    offsets = _offsets()
    for g in range(len(SIZES)):
        cols = slice(offsets[g], offsets[g + 1])
        expected = dy_values[:, cols] @ x_values[:, cols].t()
        torch.testing.assert_close(out[g].double(), expected, rtol=1e-5, atol=1e-4)
    assert out[1].abs().max() == 0.0 and out[2].abs().max() > 1.0


def test_mismatched_shapes_and_recipes_are_refused() -> None:
    a, a_scale, _ = _quantized(torch.randn(M, K), "tensorwise", "input")
    b, b_scale, _ = _weights("tensorwise")
    with pytest.raises(ValueError, match="group sizes"):
        grouped_scaled_mm(
            a, b, a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=[M, 0, 0, 1],
            recipe="tensorwise",
        )  # fmt: skip
    with pytest.raises(ValueError, match="blockwise wgrad scales must be"):
        grouped_scaled_mm_wgrad(
            a, a, a_scale_inv=a_scale, b_scale_inv=a_scale, group_sizes=[K],
            recipe="blockwise",
        )  # fmt: skip
    with pytest.raises(ValueError, match="fp32 scales"):
        grouped_scaled_mm_wgrad(
            a, a, a_scale_inv=a_scale, b_scale_inv=a_scale, group_sizes=[K], recipe="mxfp8"
        )


def _assert_close_to_emulation(got, want, *, fast: bool, out_dtype) -> None:
    """Hopper's FP8 tensor cores accumulate with fewer bits than fp32: at K = 256 the kernels
    differ from the exact emulation by up to ~4e-4 of the output's largest value with fast
    accumulation and ~3e-4 when each 128-long K block is added in fp32 (precise)
    (docs/benchmarks/grouped_gemm_fp8stats_h200_2026-12-04b.md); bf16 outputs round each value
    by up to 2^-8 more."""
    scale = want.abs().max().item()
    atol = (2e-3 if fast else 1e-3) * scale
    rtol = 2**-8 if out_dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "dgrad_e5m2"])
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
def test_triton_grouped_forward_equals_emulation_on_gpu(recipe, grad, fast) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dtype = E5M2 if grad else E4M3
    a, a_scale, _ = _quantized(
        torch.randn(M, K, device="cuda"), recipe, "grad" if grad else "input", dtype
    )
    b, b_scale, _ = _weights(recipe, "cuda")
    kwargs = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=SIZES, recipe=recipe)
    want = grouped_scaled_mm(a, b, out_dtype=torch.float32, emulate=True, **kwargs)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = grouped_scaled_mm(a, b, out_dtype=out_dtype, fast_accum=fast, **kwargs)
        # blockwise adds each K block's product to the fp32 accumulator in either mode
        _assert_close_to_emulation(
            got, want, fast=fast and recipe != "blockwise", out_dtype=out_dtype
        )


@pytest.mark.gpu
@pytest.mark.parametrize("loads", ["pointers", "tma"])
@pytest.mark.parametrize("scales", ["rows", "blockwise"])
def test_triton_ragged_m_reads_through_pointers_and_tma_alike_on_gpu(scales, loads, monkeypatch):
    """The ragged-M kernel at K = 208 (one whole and one part 128-block: masked pointer loads,
    or TMA's zeros past K), E5M2 A (the data gradient), per-row or blockwise scales."""
    _read_through(loads, monkeypatch)
    torch.manual_seed(0)
    a, b, kwargs, _ = _row_scaled_operands("cuda", k=208, a_dtype=E5M2)
    recipe = "tensorwise"
    if scales == "blockwise":
        kwargs["a_scale_inv"] = torch.rand(M, 2, device="cuda") + 0.5
        kwargs["b_scale_inv"] = torch.rand(len(SIZES), 2, 2, device="cuda") + 0.5
        recipe = "blockwise"
    assert grouped_gemm._tma_operands(a, b) == (loads == "tma")
    want = grouped_scaled_mm(a, b, out_dtype=torch.float32, emulate=True, recipe=recipe, **kwargs)
    got = grouped_scaled_mm(a, b, out_dtype=torch.float32, recipe=recipe, **kwargs)
    _assert_close_to_emulation(got, want, fast=False, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
def test_triton_grouped_weight_gradient_equals_emulation_on_gpu(fast) -> None:
    """Group starts at 0, 70, 70, 220 tokens (not multiples of 16), 223 tokens in all; an empty
    group gives 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dy_t, dy_scale, _ = _quantized(torch.randn(N, M, device="cuda"), "tensorwise", "grad", E5M2)
    x_t, x_scale, _ = _quantized(torch.randn(K, M, device="cuda"), "tensorwise", "input")
    kwargs = dict(a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES, recipe="tensorwise")
    got = grouped_scaled_mm_wgrad(dy_t, x_t, fast_accum=fast, **kwargs)
    want = grouped_scaled_mm_wgrad(dy_t, x_t, emulate=True, **kwargs)
    assert torch.count_nonzero(got[1]) == 0
    _assert_close_to_emulation(got, want, fast=fast, out_dtype=torch.float32)


@pytest.mark.gpu
def test_triton_segmented_weight_gradient_equals_emulation_on_gpu() -> None:
    """The ragged-K kernel's SEGMENTED mode (tensorwise at EP > 1): each group's segments in one
    program, every tile's product scaled by its segment's scales before it is added."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dy_t, dy_scale, _ = _segments_quantized(torch.randn(N, M) * 4, "grad", E5M2, "cuda")
    x_t, x_scale, _ = _segments_quantized(torch.randn(K, M), "input", device="cuda")
    kwargs = dict(a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES)
    kwargs.update(recipe="tensorwise", segment_group=SEGMENT_GROUP)
    got = grouped_scaled_mm_wgrad(dy_t, x_t, **kwargs)
    want = grouped_scaled_mm_wgrad(dy_t, x_t, emulate=True, **kwargs)
    _assert_close_to_emulation(got, want, fast=False, out_dtype=torch.float32)


@pytest.mark.gpu
def test_triton_blockwise_weight_gradient_equals_emulation_on_gpu() -> None:
    """The ragged-K kernel's blockwise mode: each 128-token chunk's product (chunks counted from
    each group's start) scaled by its row and column scales before it is added (precise)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dy_t, dy_scale, _ = _columnwise_groups(torch.randn(M, N, device="cuda"), "grad", E5M2)
    x_t, x_scale, _ = _columnwise_groups(torch.randn(M, K, device="cuda"), "input")
    kwargs = dict(a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES, recipe="blockwise")
    got = grouped_scaled_mm_wgrad(dy_t, x_t, **kwargs)
    want = grouped_scaled_mm_wgrad(dy_t, x_t, emulate=True, **kwargs)
    assert torch.count_nonzero(got[1]) == 0
    _assert_close_to_emulation(got, want, fast=False, out_dtype=torch.float32)


WHOLE_SIZES = [128, 0, 256, 128]
"""Groups of whole 128-token tiles (the experts' padded wgrad operands)."""


def _whole_tile_operands(scales: str, device: str):
    """Random FP8 bytes dy^T [N, M], x^T [200, M] over WHOLE_SIZES and scale_inv of `scales`
    (per_group, segmented: one per group/segment; blockwise: 128x1 cells): the kwargs."""
    m, k = sum(WHOLE_SIZES), 200
    dy_t = (torch.randn(N, m, device=device) * 8).to(E5M2)
    x_t = torch.randn(k, m, device=device).to(E4M3)
    if scales == "blockwise":
        a_s = torch.rand(N, m // 128, device=device) + 0.5
        b_s = torch.rand(k, m // 128, device=device) + 0.5
    else:
        a_s, b_s = (torch.rand(len(WHOLE_SIZES), device=device) + 0.5 for _ in range(2))
    kwargs = dict(a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=WHOLE_SIZES)
    kwargs.update(recipe="blockwise" if scales == "blockwise" else "tensorwise")
    kwargs.update(segment_group=[0, 0, 1, 1] if scales == "segmented" else None)
    return dy_t, x_t, kwargs


def _read_through(loads: str, monkeypatch) -> None:
    """On a GPU, the kernels read their operands through `loads` ("pointers" or "tma")."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if loads == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90 or later")
    monkeypatch.setattr(grouped_gemm, "_tma_runs", lambda device: loads == "tma")


def test_kernels_read_through_tma_only_on_sm90_with_aligned_rows(monkeypatch) -> None:
    """TMA descriptors need sm_90 or later, a 16-byte aligned base and 16-byte aligned rows;
    elsewhere the kernels read through pointers."""
    dy_t, x_t, _ = _whole_tile_operands("per_group", "cpu")
    assert not grouped_gemm._tma_operands(dy_t, x_t)  # CPU tensors
    monkeypatch.setattr(grouped_gemm, "_tma_runs", lambda device: True)
    assert grouped_gemm._tma_operands(dy_t, x_t)
    assert grouped_gemm._tma_operands(torch.zeros(4, N, 48, dtype=E4M3))  # stacked [G, N, K]
    odd_rows = torch.zeros(N, 514, dtype=torch.uint8)  # 514-byte rows
    assert not grouped_gemm._tma_operands(odd_rows, x_t)
    assert not grouped_gemm._tma_operands(dy_t, torch.zeros(8, 513, dtype=E4M3)[:, 1:])


@pytest.mark.gpu
@pytest.mark.parametrize("loads", ["pointers", "tma"])
@pytest.mark.parametrize("scales", ["per_group", "segmented", "blockwise"])
def test_triton_whole_tile_weight_gradient_equals_emulation_on_gpu(scales, loads, monkeypatch):
    """whole_tiles (what the layer's wgrad takes): unmasked loads of whole 128-token tiles
    through pointers or TMA descriptors; x^T's 200 rows are one whole and one part tile (TMA:
    rows past it read as zeros; pointers: clamped), an empty group gives 0."""
    _read_through(loads, monkeypatch)
    torch.manual_seed(0)
    dy_t, x_t, kwargs = _whole_tile_operands(scales, "cuda")
    assert grouped_gemm._tma_operands(dy_t, x_t) == (loads == "tma")
    got = grouped_scaled_mm_wgrad(dy_t, x_t, whole_tiles=True, **kwargs)
    want = grouped_scaled_mm_wgrad(dy_t, x_t, emulate=True, **kwargs)
    if scales != "segmented":
        assert torch.count_nonzero(got[1]) == 0
    _assert_close_to_emulation(got, want, fast=False, out_dtype=torch.float32)


@pytest.mark.gpu
def test_triton_grouped_gemms_read_strided_operands_and_outer_dim_major_scales_on_gpu() -> None:
    """The layouts the fused quantizers give (a 1x128 grid [M, K/128] that is a view of
    [K/128, M]) and transposed views of bytes: the kernels read the values, not the strides
    they were written for."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    a, a_scale, _ = _quantized(torch.randn(M, K, device="cuda"), "blockwise", "input")
    b, b_scale, _ = _weights("blockwise", "cuda")
    kwargs = dict(group_sizes=SIZES, recipe="blockwise", out_dtype=torch.float32)
    want = grouped_scaled_mm(a, b, a_scale_inv=a_scale, b_scale_inv=b_scale, **kwargs)
    strided_a = a.view(torch.uint8).t().contiguous().t().view(E4M3)
    got = grouped_scaled_mm(
        strided_a, b, a_scale_inv=a_scale.t().contiguous().t(), b_scale_inv=b_scale, **kwargs
    )
    assert a_scale.t().contiguous().t().stride() == (1, M)
    assert torch.equal(got, want)
    dy_t, dy_scale, _ = _quantized(torch.randn(N, M, device="cuda"), "tensorwise", "grad", E5M2)
    x_t, x_scale, _ = _quantized(torch.randn(K, M, device="cuda"), "tensorwise", "input")
    kwargs = dict(a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES, recipe="tensorwise")
    want = grouped_scaled_mm_wgrad(dy_t, x_t, **kwargs)
    strided_x = x_t.view(torch.uint8).t().contiguous().t().view(E4M3)
    assert torch.equal(grouped_scaled_mm_wgrad(dy_t, strided_x, **kwargs), want)


@pytest.mark.parametrize(
    "sizes", [[70, 0, 150, 3], [0, 0, 5], [128, 256, 0], [1], [0, 300, 0, 0, 129]]
)
def test_device_tile_schedule_equals_the_host_list(sizes) -> None:
    """The ragged-M kernel's schedule built from device sizes: the (group, first row) of every
    128-row tile inside one group, in order, then idle tiles (row = M, the kernel returns) up
    to the static bound (M + G * 127) // 128; each group's end row."""
    rows = sum(sizes)
    group, row, end = tile_schedule(torch.tensor(sizes), rows)
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    real = [(g, starts[g] + r) for g in range(len(sizes)) for r in range(0, sizes[g], BLOCK_M)]
    bound = (rows + len(sizes) * (BLOCK_M - 1)) // BLOCK_M
    assert len(group) == len(row) == bound >= len(real)
    assert list(zip(group.tolist(), row.tolist()))[: len(real)] == real
    assert row.tolist()[len(real) :] == [rows] * (bound - len(real))
    assert end.tolist() == [starts[g] + sizes[g] for g in range(len(sizes))]
    assert group.dtype == row.dtype == end.dtype == torch.int32


def test_group_offsets_are_the_first_token_and_chunk_of_each_group() -> None:
    """The ragged-K kernel's group bounds: groups of 0, 128, 384 and 5 tokens start at tokens
    0, 0, 128, 512 (517 in all) and at 128-token chunks 0, 0, 1, 4 (5 in all: 5 tokens take one
    short chunk)."""
    starts, chunks = group_offsets(torch.tensor([0, 128, 384, 5]))
    assert starts.dtype == chunks.dtype == torch.int32
    assert starts.tolist() == [0, 0, 128, 512, 517]
    assert chunks.tolist() == [0, 0, 1, 4, 5]


def test_the_token_tile_is_the_blockwise_cell() -> None:
    """One padded layout serves both recipes' weight gradients: the kernels' 128-token tile
    is blockwise's 128-token cell."""
    assert BLOCK_K == BLOCK_M == recipe_spec("blockwise").block == 128


def _byte_cases(device: str):
    """(data, source, want) of `transpose_bytes`: batched expert weights, and token rows
    gathered into padded columns (ragged: not multiples of the kernel's tiles; -1: zeros)."""
    generator = torch.Generator().manual_seed(11)
    weights = torch.randint(0, 256, (5, 130, 200), generator=generator, dtype=torch.uint8)
    tokens = torch.randint(0, 256, (300, 77), generator=generator, dtype=torch.uint8)
    position = torch.cat([torch.arange(0, 130), torch.arange(256, 256 + 170)])
    source = torch.full((512,), -1, dtype=torch.int32)
    source[position] = torch.arange(300, dtype=torch.int32)
    padded = torch.zeros(77, 512, dtype=torch.uint8)
    padded[:, position] = tokens.t()
    return [
        (weights.view(E4M3).to(device), None, weights.transpose(1, 2)),
        (tokens.view(E5M2).to(device), source.to(device), padded),
        (tokens[:0].to(device), source[:128].clamp(max=-1).to(device), padded[:, :128] * 0),
    ]


def test_transpose_bytes_places_rows_at_their_positions():
    """The grouped GEMMs' transposed operands: [B, R, C] -> [B, C, R]; token rows at their
    padded columns with zeros between; the FP8 dtype kept."""
    for data, source, want in _byte_cases("cpu"):
        got = transpose_bytes(data, source)
        assert got.dtype == data.dtype and torch.equal(got.view(torch.uint8), want)
    assert int(_byte_cases("cpu")[1][2][:, 130:256].sum()) == 0
    with pytest.raises(ValueError, match="transposes 2-D bytes only"):
        transpose_bytes(torch.zeros(2, 3, 4, dtype=torch.uint8), torch.arange(3))


@pytest.mark.gpu
def test_transpose_bytes_kernel_equals_torch():
    for data, source, want in _byte_cases("cuda"):
        got = transpose_bytes(data, source)
        assert got.dtype == data.dtype and torch.equal(got.view(torch.uint8).cpu(), want)
