"""GPU: the fused Triton quantizers are bitwise equal to the reference (docs/FP8_NUMERICS.md).

Every test here needs CUDA (skipped on CPU); the CPU twin is test_cuda_fallback.py.
"""

import pytest
import torch

from megatron.core.fp8 import quantize
from megatron.core.fp8.cuda import quantize_cuda, transpose_fp8, triton_available
from tests.unit_tests.fp8.selfcheck import (
    CHECK_FORMATS,
    CHECK_RECIPES,
    check_cases,
    compare_case_both_ways,
)

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat bytes of any tensor (0-d scales included) for a bitwise comparison."""
    return t.reshape(-1).view(torch.uint8)


def test_triton_kernels_are_the_path_under_test():
    # Without Triton every test below would silently compare the torch fallback.
    assert triton_available(), "Triton is not importable on this GPU machine"


@pytest.mark.parametrize("fp8_dtype", CHECK_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", CHECK_RECIPES)
def test_bytes_and_scales_equal_reference(recipe, fp8_dtype):
    """Random inputs of 6 shapes and all edge cases, bf16 and fp32, every role and scale
    option, with and without the transposed copy: rowwise, columnwise and transposed bytes,
    scales and amax bitwise equal."""
    cases = check_cases("cuda", recipes=(recipe,), fp8_dtypes=(fp8_dtype,))
    failures = [message for case in cases for message in compare_case_both_ways(case)]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:15])


def test_public_quantize_cuda_backend_equals_reference():
    x = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16) * 5
    for recipe, role in (("tensorwise", "input"), ("blockwise", "weight"), ("mxfp8", "grad")):
        kwargs = dict(recipe=recipe, fp8_dtype=E4M3, role=role, rowwise=True, columnwise=True)
        got = quantize(x, backend="cuda", **kwargs)
        want = quantize(x, backend="reference", **kwargs)
        for key in ("rowwise_data", "columnwise_data"):
            assert torch.equal(getattr(got, key), getattr(want, key)), (recipe, key)
        for key in ("rowwise_scale_inv", "columnwise_scale_inv"):
            assert torch.equal(_bytes(getattr(got, key)), _bytes(getattr(want, key))), key


def test_cast_rounds_to_nearest_even_and_saturates():
    """Explicit bytes: ties go to the even mantissa, large values and Inf saturate to 0x7E,
    NaN stays NaN (0x7F), negative values carry the sign bit."""
    values = [
        1.0625,
        1.1875,
        -1.0625,
        0.0,
        -0.0,
        448.0,
        464.0,
        480.0,
        1e9,
        float("inf"),
        float("-inf"),
        float("nan"),
        2.0**-10,
        3 * 2.0**-10,
    ]
    # 1.0625 ties 1.0/1.125 -> 1.0; 1.1875 ties 1.125/1.25 -> 1.25; 2^-10 ties 0/2^-9 -> 0;
    # 3*2^-10 ties 2^-9/2^-8 -> 2^-8 (mantissa 010).
    expected = [0x38, 0x3A, 0xB8, 0x00, 0x80, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x00, 0x02]
    x = torch.tensor([values], device="cuda")
    out = quantize_cuda(
        x,
        recipe="delayed",
        fp8_dtype=E4M3,
        role="input",
        rowwise=True,
        columnwise=False,
        scale=torch.tensor(1.0, device="cuda"),
        power_2_scale=False,
    )
    assert out["rowwise_data"].flatten().tolist() == expected
    assert out["amax"].item() == float("inf")


def test_e5m2_saturates_instead_of_inf():
    x = torch.tensor([[57344.0, 61440.0, 1e6, float("-inf"), 1.25]], device="cuda")
    out = quantize_cuda(
        x,
        recipe="delayed",
        fp8_dtype=E5M2,
        role="grad",
        rowwise=True,
        columnwise=False,
        scale=torch.tensor(1.0, device="cuda"),
        power_2_scale=False,
    )
    # 57344 = 0x7B is E5M2's max; 61440 is the tie with Inf and must saturate, not overflow.
    assert out["rowwise_data"].flatten().tolist() == [0x7B, 0x7B, 0x7B, 0xFB, 0x3D]


def test_tensorwise_with_given_amax_uses_it():
    x = torch.randn(64, 256, device="cuda")
    amax = torch.tensor(10.0, device="cuda")
    got = quantize_cuda(
        x,
        recipe="tensorwise",
        fp8_dtype=E4M3,
        role="weight",
        rowwise=True,
        columnwise=False,
        power_2_scale=False,
        amax=amax,
    )
    want = quantize(
        x, recipe="tensorwise", fp8_dtype=E4M3, role="weight", amax=amax, backend="reference"
    )
    assert got["amax"].item() == 10.0
    assert got["rowwise_scale_inv"].item() == (torch.tensor(1.0) / torch.tensor(44.8)).item()
    assert torch.equal(got["rowwise_data"], want.rowwise_data)


def test_delayed_records_nan_ignoring_amax():
    x = torch.randn(96, 200, device="cuda")
    x[3, 4] = -37.5
    x[7, 9] = float("nan")
    out = quantize_cuda(
        x,
        recipe="delayed",
        fp8_dtype=E4M3,
        role="input",
        rowwise=True,
        columnwise=False,
        scale=torch.tensor(4.0, device="cuda"),
        power_2_scale=False,
    )
    assert out["amax"].item() == 37.5
    assert out["rowwise_scale_inv"].item() == 0.25


@pytest.mark.parametrize("shape", [(1, 1), (1, 300), (300, 1), (128, 128), (333, 4097)])
def test_transpose_fp8_equals_torch_transpose(shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    assert torch.equal(transpose_fp8(data), data.t().contiguous())
    as_fp8 = data.view(E4M3)
    assert torch.equal(transpose_fp8(as_fp8).view(torch.uint8), data.t().contiguous())


@pytest.mark.parametrize("recipe", CHECK_RECIPES)
def test_large_tensor_many_programs(recipe):
    """A 4096 x 6144 bf16 tensor (thousands of programs, amax from atomics across them)."""
    x = torch.randn(4096, 6144, device="cuda", dtype=torch.bfloat16)
    x[4000, 6000] = 1000.0
    scale = torch.tensor(0.4375, device="cuda") if recipe == "delayed" else None
    kwargs = dict(
        recipe=recipe, fp8_dtype=E4M3, role="input", rowwise=True, columnwise=True, scale=scale
    )
    want = quantize(x, backend="reference", **kwargs)
    got = quantize_cuda(x, power_2_scale=recipe in ("blockwise", "mxfp8"), **kwargs)
    assert got["amax"].item() == 1000.0
    for key in ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv"):
        assert torch.equal(_bytes(got[key]), _bytes(getattr(want, key))), key
