"""CPU twin of the GPU tests: the plain-torch fallback of megatron.core.fp8.cuda equals the
reference bitwise, GEMM scale layouts agree with the reference dequantize, and the package
imports without Triton."""

import subprocess
import sys

import pytest
import torch

from megatron.core.fp8 import quantize
from megatron.core.fp8.cuda import scaled_mm
from megatron.core.fp8.cuda.gemm import swizzle_mx_scales
from tests.unit_tests.fp8.selfcheck import check_cases, compare_case_both_ways

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_torch_fallback_equals_reference(recipe):
    cases = check_cases("cpu", recipes=(recipe,), quick=True)
    failures = [message for case in cases for message in compare_case_both_ways(case)]
    assert len(cases) >= 22
    assert not failures, "\n".join(failures[:10])


def test_package_imports_and_quantizes_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from megatron.core.fp8.cuda import quantize_cuda, triton_available\n"
        "assert not triton_available()\n"
        "out = quantize_cuda(torch.ones(2, 4), recipe='tensorwise', fp8_dtype=torch.float8_e4m3fn,"
        " role='input', rowwise=True, columnwise=False, power_2_scale=False)\n"
        "print(out['rowwise_data'].flatten().tolist(), out['rowwise_scale_inv'].item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # amax 1 -> scale 448 -> every byte is 448 = 0x7E; scale_inv = fp32(1/448).
    assert result.stdout.split()[0] == "[126,"
    assert float(result.stdout.split()[-1]) == (torch.tensor(1.0) / 448.0).item()


def _rowwise_operand(x, *, recipe, role):
    qt = quantize(x, recipe=recipe, fp8_dtype=E4M3, role=role, backend="reference")
    return qt.rowwise_data.view(E4M3), qt.rowwise_scale_inv, qt


@pytest.mark.parametrize(
    "recipe, roles",
    [
        ("tensorwise", ("input", "weight")),
        ("blockwise", ("input", "weight")),
        ("blockwise", ("input", "grad")),
        ("blockwise", ("weight", "input")),
        ("mxfp8", ("input", "weight")),
    ],
)
def test_emulated_gemm_reads_scales_like_the_reference(recipe, roles):
    """On CPU scaled_mm emulates; its product must equal the product of the reference's own
    dequantized tensors, bit for bit (same fp32 values, same matmul)."""
    torch.manual_seed(0)
    a, a_sinv, a_qt = _rowwise_operand(torch.randn(130, 300) * 7, recipe=recipe, role=roles[0])
    b, b_sinv, b_qt = _rowwise_operand(torch.randn(140, 300), recipe=recipe, role=roles[1])
    y = scaled_mm(
        a,
        b,
        a_scale_inv=a_sinv,
        b_scale_inv=b_sinv,
        recipe=recipe,
        out_dtype=torch.float32,
        use_fast_accum=False,
        emulate=recipe != "blockwise",
    )
    want = a_qt.dequantize(torch.float32) @ b_qt.dequantize(torch.float32).t()
    assert torch.equal(y, want)


def test_mxfp8_gemm_is_refused_off_sm100():
    a = torch.zeros(32, 64).to(E4M3)
    scales = torch.full((32, 2), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="sm_100"):
        scaled_mm(
            a,
            a,
            a_scale_inv=scales,
            b_scale_inv=scales,
            recipe="mxfp8",
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )


def test_gemm_argument_errors_name_the_fix():
    a = torch.zeros(32, 256).to(E5M2)
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        scaled_mm(
            a,
            a,
            a_scale_inv=one,
            b_scale_inv=one,
            recipe="tensorwise",
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )
    w = torch.zeros(256, 256).to(E4M3)
    grid = torch.ones(2, 2)
    with pytest.raises(ValueError, match="at most one operand"):
        scaled_mm(
            w,
            w,
            a_scale_inv=grid,
            b_scale_inv=grid,
            recipe="blockwise",
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )
    with pytest.raises(TypeError, match="FP8 tensors"):
        scaled_mm(
            w.view(torch.uint8),
            w,
            a_scale_inv=one,
            b_scale_inv=one,
            recipe="tensorwise",
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )


def test_mx_scale_swizzle_layout():
    """cuBLAS 32_4_4 layout: (r, c) of a 128x4 tile at (r % 32) * 16 + (r // 32) * 4 + c,
    tiles row-block-major, padding rows/columns filled with byte 127 (2^0)."""
    scales = torch.randint(0, 255, (130, 6), dtype=torch.uint8)
    flat = swizzle_mx_scales(scales).view(torch.uint8)
    assert flat.numel() == 256 * 8
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 5), (128, 0), (129, 4), (77, 2)]:
        tile = (r // 128) * 2 + c // 4
        rr, cc = r % 128, c % 4
        assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] == scales[r, c]
    assert flat[1 * 512 + 0 * 16 + 0 * 4 + 2] == 127  # row 0, column 6: a padding column
