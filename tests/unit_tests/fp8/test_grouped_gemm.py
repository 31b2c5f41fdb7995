"""The FP8 grouped GEMMs of the MoE experts (fp8/cuda/grouped_gemm.py).

CPU: the emulated path (one exact emulated GEMM per group) equals a float64 product of the
operands dequantized in the test, group by group, for each recipe; empty groups give empty
rows (forward) or zero blocks (weight gradient); mismatched shapes are refused.
GPU (H200): the Triton kernels equal the emulated path within the fast-accumulation bound
(FAST_ACCUM_BOUND), on ragged group sizes (0, < 128, not multiples of 128) and N, K not
multiples of 128."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.cuda.grouped_gemm import grouped_scaled_mm, grouped_scaled_mm_wgrad
from megatron.core.fp8.quantization import quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [70, 0, 150, 3]
M, N, K = sum(SIZES), 160, 256
FAST_ACCUM_BOUND = 2e-3
"""The kernels against their exact emulation: Hopper's FP8 tensor cores accumulate with fewer
bits than fp32 inside each tl.dot (Triton's default on sm_90, as cuBLAS's fast accumulation),
measured ~4e-4 of the output's max|.| uniformly over groups and columns on the H200; asserted
at 2e-3 of it (plus one bf16 rounding for bf16 outputs)."""


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


def test_mismatched_shapes_and_recipes_are_refused() -> None:
    a, a_scale, _ = _quantized(torch.randn(M, K), "tensorwise", "input")
    b, b_scale, _ = _weights("tensorwise")
    with pytest.raises(ValueError, match="group sizes"):
        grouped_scaled_mm(
            a, b, a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=[M, 0, 0, 1],
            recipe="tensorwise",
        )  # fmt: skip
    with pytest.raises(ValueError, match="per-tensor recipes"):
        grouped_scaled_mm_wgrad(
            a, a, a_scale_inv=a_scale, b_scale_inv=a_scale, group_sizes=[K],
            recipe="blockwise",
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "dgrad_e5m2"])
def test_triton_grouped_forward_equals_emulation_on_gpu(recipe, grad) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dtype = E5M2 if grad else E4M3
    a, a_scale, _ = _quantized(
        torch.randn(M, K, device="cuda"), recipe, "grad" if grad else "input", dtype
    )
    b, b_scale, _ = _weights(recipe, "cuda")
    kwargs = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=SIZES, recipe=recipe)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = grouped_scaled_mm(a, b, out_dtype=out_dtype, **kwargs)
        want = grouped_scaled_mm(a, b, out_dtype=torch.float32, emulate=True, **kwargs)
        rounding = 0.0 if out_dtype == torch.float32 else 2**-8
        bound = FAST_ACCUM_BOUND * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=rounding, atol=bound)


@pytest.mark.gpu
def test_triton_grouped_weight_gradient_equals_emulation_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dy_t, dy_scale, _ = _quantized(torch.randn(N, M, device="cuda"), "tensorwise", "grad", E5M2)
    x_t, x_scale, _ = _quantized(torch.randn(K, M, device="cuda"), "tensorwise", "input")
    kwargs = dict(a_scale_inv=dy_scale, b_scale_inv=x_scale, group_sizes=SIZES, recipe="tensorwise")
    got = grouped_scaled_mm_wgrad(dy_t, x_t, **kwargs)
    want = grouped_scaled_mm_wgrad(dy_t, x_t, emulate=True, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=FAST_ACCUM_BOUND * want.abs().max().item())
