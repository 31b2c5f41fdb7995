"""GPU: scaled_mm (torch._scaled_mm) equals the exactly dequantized product up to accumulation
order and the output rounding. CPU twin: test_cuda_fallback.py."""

import pytest
import torch

from megatron.core.fp8.cuda import blockwise_gemm_path, linear_ops, quantize_cuda, scaled_mm
from megatron.core.fp8.cuda.gemm import dequantize_operand
from megatron.core.fp8.quantized_tensor import Fp8Operand

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (M, K, N): aligned, ragged (padding to 16 / 128 inside scaled_mm), one row; K-block counts
# of 5, 6 and 4.5 (a 128x128 grid with rows padded to 4 blocks, or K padded to 512).
SHAPES = [
    (256, 512, 384),
    (100, 200, 72),
    (1, 128, 16),
    (130, 640, 260),
    (64, 768, 256),
    (96, 576, 128),
]


def _operand(x, *, recipe, role, fp8_dtype=E4M3, scale=None):
    """Rowwise FP8 operand (data as an FP8 dtype, logical scale_inv) of a [rows, K] tensor."""
    pow2 = recipe != "tensorwise"  # ignored by delayed (given scale) and mxfp8 (always pow2)
    out = quantize_cuda(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=True,
        columnwise=False,
        scale=scale,
        power_2_scale=pow2,
    )
    return out["rowwise_data"].view(fp8_dtype), out["rowwise_scale_inv"]


def _check_close(y, a, a_sinv, b, b_sinv, *, recipe, out_dtype, fast_accum):
    """|y - exact| within the output rounding plus an accumulation-order term bounded by the
    sum of |products| (fp8 x fp8 products are exact in fp32; only the sum order differs)."""
    a_exact = dequantize_operand(a, a_sinv, recipe=recipe, dtype=torch.float64)
    b_exact = dequantize_operand(b, b_sinv, recipe=recipe, dtype=torch.float64)
    exact = a_exact @ b_exact.t()
    abs_sum = a_exact.abs() @ b_exact.abs().t()
    rounding = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    # Hopper's FP8 tensor cores add each MMA's products into an accumulator that keeps about
    # 14 significant bits (DeepSeek-V3 report, 3.3.2, measured on H800). Split (promoted)
    # accumulation moves those partial sums into fp32 only every few MMAs (per 128-wide K
    # block under blockwise scaling), so even there each chunk carries an error near 2^-13 of
    # its sum of |products|; the earlier 2^-18 assumed fp32 accumulation throughout and
    # failed on cuBLAS (45.7x). Measured on an H200 (torch 2.11, CUDA 13): worst 2^-14.4 with
    # fp32 output, split and fast alike at these sizes; 2^-12 leaves a 5x margin. Fast
    # accumulation never promotes, so it keeps the looser 2^-10.
    order = 2.0**-10 if fast_accum else 2.0**-12
    bound = rounding * exact.abs() + order * abs_sum + 1e-30
    err = (y.double() - exact).abs()
    worst = (err / bound).max().item()
    # Logged (pytest -s) so that the GPU run records the measured accumulation error.
    print(
        f"gemm-accuracy {recipe} fast={fast_accum} {out_dtype}: worst |err|/sum|products| = "
        f"2^{torch.log2((err / (abs_sum + 1e-30)).max()).item():.2f}"
    )
    assert y.dtype == out_dtype and y.shape == exact.shape
    assert worst <= 1.0, f"error {worst:.3g}x the bound"


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_per_tensor_scaled_mm(shape, recipe, out_dtype, fast_accum):
    m, k, n = shape
    torch.manual_seed(0)
    scale = torch.tensor(16.0, device="cuda") if recipe == "delayed" else None
    a, a_sinv = _operand(torch.randn(m, k, device="cuda"), recipe=recipe, role="input", scale=scale)
    b, b_sinv = _operand(
        torch.randn(n, k, device="cuda") * 0.1, recipe=recipe, role="weight", scale=scale
    )
    y = scaled_mm(
        a,
        b,
        a_scale_inv=a_sinv,
        b_scale_inv=b_sinv,
        recipe=recipe,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    _check_close(y, a, a_sinv, b, b_sinv, recipe=recipe, out_dtype=out_dtype, fast_accum=fast_accum)


def test_per_tensor_e4m3_by_e5m2_dgrad_pair():
    torch.manual_seed(1)
    grad, g_sinv = _operand(
        torch.randn(128, 256, device="cuda") * 1e-3,
        recipe="tensorwise",
        role="grad",
        fp8_dtype=E5M2,
    )
    w_t, w_sinv = _operand(torch.randn(192, 256, device="cuda"), recipe="tensorwise", role="weight")
    y = scaled_mm(
        grad,
        w_t,
        a_scale_inv=g_sinv,
        b_scale_inv=w_sinv,
        recipe="tensorwise",
        out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    _check_close(
        y,
        grad,
        g_sinv,
        w_t,
        w_sinv,
        recipe="tensorwise",
        out_dtype=torch.bfloat16,
        fast_accum=False,
    )


# (a role, b role): fprop/dgrad (1x128 x 128x128), wgrad (1x128 x 1x128), and the mirror pair.
BLOCK_PAIRS = [("input", "weight"), ("input", "grad"), ("weight", "input")]
PAIR_IDS = ["1x128_128x128", "1x128_1x128", "128x128_1x128"]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("roles", BLOCK_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise_scaled_mm(shape, roles, out_dtype):
    m, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda")
    x[:, : min(k, 128)] *= 100.0  # different K blocks need different scales
    a, a_sinv = _operand(x, recipe="blockwise", role=roles[0])
    b, b_sinv = _operand(torch.randn(n, k, device="cuda"), recipe="blockwise", role=roles[1])
    y = scaled_mm(
        a,
        b,
        a_scale_inv=a_sinv,
        b_scale_inv=b_sinv,
        recipe="blockwise",
        out_dtype=out_dtype,
        use_fast_accum=False,
    )
    _check_close(y, a, a_sinv, b, b_sinv, recipe="blockwise", out_dtype=out_dtype, fast_accum=False)


def test_blockwise_runs_on_cublas_on_sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLASLt blockwise scaling exists on sm_90 only")
    a, a_sinv = _operand(torch.randn(256, 512, device="cuda"), recipe="blockwise", role="input")
    b, b_sinv = _operand(torch.randn(256, 512, device="cuda"), recipe="blockwise", role="weight")
    scaled_mm(
        a,
        b,
        a_scale_inv=a_sinv,
        b_scale_inv=b_sinv,
        recipe="blockwise",
        out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    assert blockwise_gemm_path() == "torch._scaled_mm", blockwise_gemm_path()


def test_mxfp8_gemm_refused_below_sm100_else_matches():
    a, a_sinv = _operand(torch.randn(128, 256, device="cuda"), recipe="mxfp8", role="input")
    b, b_sinv = _operand(torch.randn(64, 256, device="cuda"), recipe="mxfp8", role="weight")
    kwargs = dict(
        a_scale_inv=a_sinv,
        b_scale_inv=b_sinv,
        recipe="mxfp8",
        out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    if torch.cuda.get_device_capability()[0] < 10:
        with pytest.raises(RuntimeError, match="sm_100"):
            scaled_mm(a, b, **kwargs)
    else:
        _check_close(
            scaled_mm(a, b, **kwargs),
            a,
            a_sinv,
            b,
            b_sinv,
            recipe="mxfp8",
            out_dtype=torch.bfloat16,
            fast_accum=False,
        )
    emulated = scaled_mm(a, b, emulate=True, **kwargs)
    _check_close(
        emulated, a, a_sinv, b, b_sinv, recipe="mxfp8", out_dtype=torch.bfloat16, fast_accum=False
    )


def test_e5m2_by_e5m2_rejected():
    g, g_sinv = _operand(
        torch.randn(32, 64, device="cuda"), recipe="tensorwise", role="grad", fp8_dtype=E5M2
    )
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        scaled_mm(
            g,
            g,
            a_scale_inv=g_sinv,
            b_scale_inv=g_sinv,
            recipe="tensorwise",
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )


@pytest.mark.parametrize(
    "recipe, rows, k, n",
    # M-small's fc1 with an expert's 433 tokens (general path); blockwise at a shape its
    # scales need no padding for (a padded grid is a fresh, aligned copy anyway) and that the
    # direct path takes (rows a multiple of 16, K of 512).
    [("tensorwise", 433, 768, 512), ("tensorwise", 448, 768, 512), ("blockwise", 448, 1024, 512)],
)
def test_a_scale_view_off_cublas_alignment_gives_the_aligned_product(recipe, rows, k, n):
    """Expert 1's scale of a stacked weight sits 4 bytes into the stack (fp8_experts.ExpertWeight).
    cuBLASLt refused such a scale on the H100 (CUBLAS_STATUS_NOT_SUPPORTED, delayed MoE,
    2026-12-07); scaled_mm and linear_ops.gemm now give the product of aligned scales, bit for
    bit."""
    torch.manual_seed(2)
    a, a_sinv = _operand(torch.randn(rows, k, device="cuda"), recipe=recipe, role="input")
    b, b_sinv = _operand(torch.randn(n, k, device="cuda") * 0.1, recipe=recipe, role="weight")
    shifted = []
    for scale in (a_sinv, b_sinv):
        storage = torch.ones(scale.numel() + 1, device="cuda")
        shifted.append(storage.as_strided(scale.shape, scale.stride(), 1).copy_(scale))
        assert shifted[-1].data_ptr() % 16 == 4 and torch.equal(shifted[-1], scale)
    args = dict(recipe=recipe, out_dtype=torch.bfloat16)
    want = scaled_mm(a, b, a_scale_inv=a_sinv, b_scale_inv=b_sinv, use_fast_accum=False, **args)
    got = scaled_mm(
        a, b, a_scale_inv=shifted[0], b_scale_inv=shifted[1], use_fast_accum=False, **args
    )
    operands = (Fp8Operand(a, shifted[0]), Fp8Operand(b, shifted[1]))
    direct = linear_ops.gemm(*operands, fast_accum=False, **args)
    assert torch.equal(got, want) and torch.equal(direct, want)
