"""The integer shortcuts in triton_common.py, written out in torch here, against the reference
rules (docs/FP8_NUMERICS.md) on CPU:

- `_pow2_scale`: the power-of-two scale from exponent arithmetic instead of clear_mantissa(
  RN(fp8_max / amax)), with the Inf replacement of each input dtype;
- `_e8m0_from_amax`: the E8M0 byte in three integer steps instead of the rule's branches.

The GPU self-check (tests/unit_tests/fp8/selfcheck.py) tests the compiled kernels themselves;
these tests pin the arithmetic on every fp32 exponent, at the mantissas where the rules change,
and at random mantissas. An exhaustive sweep of all 2^31 patterns (0 mismatches) is recorded in
docs/benchmarks/fp8_quantize_instructions_h200_2026-12-01.md."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.formats import e8m0_from_t, fp8_max
from megatron.core.fp8.reference import scale_from_amax

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Mantissas where a rule turns: 0, just above 0, 1.75's (0x600000) and the half-subnormal
# threshold of E8M0 (0x400000) with their neighbours, the largest.
EDGE_MANTISSAS = (
    0,
    1,
    2,
    0x3FFFFF,
    0x400000,
    0x400001,
    0x5FFFFF,
    0x600000,
    0x600001,
    0x7FFFFE,
    0x7FFFFF,
)


def _non_negative_bits() -> torch.Tensor:
    """int32 bit patterns: every exponent field 0..254 with the edge mantissas and 64 random
    ones, plus +0 and +Inf."""
    gen = torch.Generator().manual_seed(0)
    mantissas = torch.cat(
        [torch.tensor(EDGE_MANTISSAS), torch.randint(0, 1 << 23, (64,), generator=gen)]
    )
    exponents = torch.arange(0, 255)
    bits = (exponents[:, None] << 23) | mantissas[None, :]
    return torch.cat([bits.reshape(-1), torch.tensor([0x7F800000])]).to(torch.int32)


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


def pow2_scale_shortcut(amax: torch.Tensor, fp8_dtype, inf_scale: float) -> torch.Tensor:
    """_pow2_scale and _scale_from_amax's usable test, as triton_common.py computes them."""
    f = {448.0: 8, 57344.0: 15}[fp8_max(fp8_dtype)]
    bits = amax.view(torch.int32)
    exponent = bits >> 23
    scale_exponent = 254 + f - exponent - ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    inf_bits = torch.tensor(inf_scale, dtype=torch.float32).view(torch.int32) & 0x7F800000
    overflow = (exponent == 0) | (scale_exponent >= 255)
    scale = _as_float(torch.where(overflow, inf_bits, scale_exponent << 23))
    usable = (amax > 0) & (bits < 0x7F800000)
    return torch.where(usable, scale, torch.ones_like(scale))


def e8m0_shortcut(amax: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """_e8m0_from_amax as triton_common.py computes it (amax >= 0, not NaN)."""
    t = amax * torch.tensor(1.0 / fp8_max(fp8_dtype), dtype=torch.float32)
    bits = t.view(torch.int32)
    carry = torch.where(bits < 0x00800000, 0x003FFFFF, 0x007FFFFF).to(torch.int32)
    return torch.clamp((bits + carry) >> 23, max=254)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pow2_scale_shortcut_equals_the_reference(fp8_dtype, input_dtype):
    inf_scale = float(torch.finfo(input_dtype).max)  # blockwise: the input dtype's max
    amax = _as_float(_non_negative_bits())
    want = scale_from_amax(
        amax, fp8_dtype=fp8_dtype, power_2_scale=True, infinite_scale_value=inf_scale
    )
    got = pow2_scale_shortcut(amax, fp8_dtype, inf_scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # The sweep reached the Inf replacement, its neighbour and the unusable amaxes.
    inf_pow2 = _as_float(
        torch.tensor(inf_scale, dtype=torch.float32).view(torch.int32) & 0x7F800000
    )
    assert bool((got == inf_pow2).any())
    assert int((got == 1.0).sum()) >= 2  # amax 0 and +Inf


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_e8m0_shortcut_equals_the_rule(fp8_dtype):
    amax = _as_float(_non_negative_bits())
    t = amax * torch.tensor(1.0 / fp8_max(fp8_dtype), dtype=torch.float32)
    want = e8m0_from_t(t).to(torch.int32)
    got = e8m0_shortcut(amax, fp8_dtype)
    assert torch.equal(got, want)
    assert set(got.unique().tolist()) >= {0, 1, 254}  # subnormal t, the round-up, +Inf
