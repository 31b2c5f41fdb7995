"""dequantize(quantize(x)) error bounds and SQNR, per recipe (docs/FP8_NUMERICS.md tolerances)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.fp8 import E4M3, E5M2, quantize

# Relative step of each format: half an ulp at the top of a binade (3 and 2 mantissa bits).
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    noise = (x.double() - x_hat.double()).pow(2).sum()
    return 10.0 * math.log10(x.double().pow(2).sum().item() / noise.item())


def test_e4m3_tensorwise_sqnr_of_unit_normal():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    qt = quantize(x, recipe="tensorwise", fp8_dtype=E4M3, role="input")
    db = sqnr_db(x, qt.dequantize())
    # E4M3 with 3 mantissa bits gives about 31 dB on a Gaussian; the spec floor is 25 dB.
    assert 29.0 <= db <= 33.0, db


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize(
    ("recipe", "role", "columnwise"),
    [
        ("tensorwise", "input", False),
        ("blockwise", "input", False),
        ("blockwise", "grad", True),
        ("blockwise", "weight", False),
        ("mxfp8", "input", False),
        ("mxfp8", "input", True),
    ],
)
def test_elementwise_error_bound_for_normal_range_values(recipe, role, columnwise, fp8_dtype):
    gen = torch.Generator().manual_seed(1)
    # Values within a factor 8 of each block's max stay in FP8's normal range: error <= half ulp.
    x = (1.0 + 7.0 * torch.rand(96, 160, generator=gen)) * torch.sign(torch.randn(96, 160))
    if recipe != "tensorwise" and role != "weight" and not columnwise:
        # 1xB blocks each have their own scale, so rows may differ by a factor 10^6.
        x = x * 10.0 ** torch.randint(-3, 4, (96, 1), generator=gen).float()
    qt = quantize(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=not columnwise,
        columnwise=columnwise,
    )
    rel = ((qt.dequantize() - x).abs() / x.abs()).max().item()
    assert rel <= HALF_ULP[fp8_dtype] * (1 + 1e-6), rel
    assert rel > HALF_ULP[fp8_dtype] * 0.75, rel  # the bound is tight: really 3 (2) bits


def test_dequantize_keeps_input_dtype_and_crops_padding():
    x = torch.randn(3, 45, generator=torch.Generator().manual_seed(2)).bfloat16()
    qt = quantize(x, recipe="mxfp8", fp8_dtype=E4M3, role="input", columnwise=True)
    out = qt.dequantize()
    assert out.dtype == torch.bfloat16 and out.shape == (3, 45)
    # Dequantizing is exact q * 2^k, so re-quantizing keeps every value (not always the bytes:
    # see the next test).
    again = quantize(out, recipe="mxfp8", fp8_dtype=E4M3, role="input")
    assert torch.equal(again.dequantize(), out)


def test_mxfp8_requantize_may_pick_the_next_lower_scale():
    """A block whose amax rounds down to 224 * 2^k dequantizes to an amax whose t is exactly
    2^(k-1): the second quantization takes E8M0 byte e - 1 and doubles every byte's value,
    with the same dequantized values (docs/FP8_NUMERICS.md, mxfp8 steps 2-3)."""
    x = torch.full((1, 32), 1.796875)  # x * 2^7 = 230 rounds to 224 in E4M3
    first = quantize(x, recipe="mxfp8", fp8_dtype=E4M3, role="input")
    second = quantize(first.dequantize(), recipe="mxfp8", fp8_dtype=E4M3, role="input")
    assert first.rowwise_scale_inv.view(torch.uint8).unique().tolist() == [120]
    assert second.rowwise_scale_inv.view(torch.uint8).unique().tolist() == [119]
    assert first.rowwise_data.view(E4M3).float().unique().tolist() == [224.0]
    assert second.rowwise_data.view(E4M3).float().unique().tolist() == [448.0]
    assert torch.equal(second.dequantize(), first.dequantize())
    assert first.dequantize().unique().tolist() == [1.75]
