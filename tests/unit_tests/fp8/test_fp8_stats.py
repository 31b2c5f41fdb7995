"""megatron.core.fp8.stats against references computed here in numpy (issue 41, acceptance 3).

The references use only the format facts: E4M3 max 448 and smallest subnormal 2^-9, E5M2
max 57344 and smallest subnormal 2^-16. A non-zero value flushes to zero exactly when
|x * scale| <= half the smallest subnormal (round to nearest even ties to 0), and saturates
when rounding would leave the format (so the cast's clamp changes it): |x * scale| > 464 for
E4M3 (448 + half its ulp of 32; the tie goes to 448's even mantissa), >= 61440 for E5M2
(57344 + half its ulp of 8192; the tie goes up, to 65536).
"""

import numpy as np
import pytest
import torch

from megatron.core.fp8.formats import E4M3, E5M2
from megatron.core.fp8.stats import (
    STATS_FIELDS,
    fp8_stats_vector,
    fp8_tensor_stats,
    stats_from_vector,
)

FORMAT = {E4M3: (448.0, 2.0**-9), E5M2: (57344.0, 2.0**-16)}
SATURATES = {E4M3: lambda a: a > 464.0, E5M2: lambda a: a >= 61440.0}


def _pow2_floor(v: np.ndarray) -> np.ndarray:
    mantissa, exponent = np.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return np.ldexp(np.float32(1.0), exponent - 1).astype(np.float32)


def _pow2_ceil(v: np.ndarray) -> np.ndarray:
    mantissa, exponent = np.frexp(v)
    return np.ldexp(np.float32(1.0), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(
        np.float32
    )


def _cells(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Per-element amax of its [rows, cols] cell (x's dims are multiples here)."""
    m, k = x.shape
    blocks = np.abs(x).reshape(m // rows, rows, k // cols, cols).max(axis=(1, 3))
    return np.repeat(np.repeat(blocks, rows, axis=0), cols, axis=1)


def _reference_multiplier(x, recipe, role, fp8_max, scale):
    if recipe == "delayed":
        return np.full_like(x, scale)
    if recipe == "tensorwise":
        return np.full_like(x, np.float32(fp8_max) / np.abs(x).max())
    if recipe == "blockwise":
        amax = _cells(x, 128, 128) if role == "weight" else _cells(x, 1, 128)
        return _pow2_floor(np.float32(fp8_max) / amax)
    amax = _cells(x, 1, 32)  # mxfp8: E8M0 = amax * fp32(1/max) rounded up to a power of two
    return (np.float32(1.0) / _pow2_ceil(amax * (np.float32(1.0) / np.float32(fp8_max)))).astype(
        np.float32
    )


def _reference(x, recipe, role, fp8_dtype, scale=None):
    fp8_max, smallest = FORMAT[fp8_dtype]
    scaled = np.abs(x * _reference_multiplier(x, recipe, role, fp8_max, scale))
    nonzero = x != 0
    saturated = SATURATES[fp8_dtype](scaled).mean()
    return saturated, (nonzero & (scaled <= smallest / 2)).sum() / nonzero.sum()


def _wide_range_tensor(seed: int) -> torch.Tensor:
    """256 x 256 fp32 values spread over 2^-30 .. 2^6, some exact zeros, some huge outliers."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-30, 7, (256, 256), generator=gen).to(torch.float32)
    sign = torch.randint(0, 2, (256, 256), generator=gen).to(torch.float32) * 2 - 1
    x = sign * torch.rand(256, 256, generator=gen) * torch.exp2(exponent)
    x[0, :5] = 0.0
    x[3, 7] = 3000.0
    return x


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "delayed"])
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_fractions_match_numpy_reference(recipe, role):
    x = _wide_range_tensor(seed=7)
    fp8_dtype = E5M2 if role == "grad" else E4M3
    scale = torch.tensor(2.0**-2) if recipe == "delayed" else None
    stats = fp8_tensor_stats(x, recipe=recipe, role=role, scale=scale)
    saturated, underflow = _reference(x.numpy(), recipe, role, fp8_dtype, scale=0.25)
    assert stats.fp8_dtype == ("float8_e5m2" if role == "grad" else "float8_e4m3fn")
    assert stats.amax == 3000.0
    assert stats.numel == 65536 and stats.nonzero == 65531
    assert stats.saturated_fraction == pytest.approx(saturated, abs=0)
    assert stats.underflow_fraction == pytest.approx(underflow, abs=0)
    if recipe in ("tensorwise", "blockwise", "mxfp8"):
        assert stats.saturated_fraction == 0.0  # current scaling never saturates by design
    assert 0.0 < stats.underflow_fraction < 1.0


def test_hand_counted_tensorwise_and_delayed():
    # amax 448 -> tensorwise scale exactly 1.0: 2^-10 flushes (tie to even 0), 2^-9 survives.
    x = torch.tensor([[448.0, 1.0, 2.0**-10, 2.0**-9, 0.0, -(2.0**-11), 100.0, -3.0]])
    stats = fp8_tensor_stats(x, recipe="tensorwise", role="input")
    assert (stats.amax, stats.scale, stats.num_scales) == (448.0, 1.0, 1)
    assert stats.saturated_fraction == 0.0
    assert stats.underflow_fraction == 2 / 7  # 2^-10 and -2^-11 of the 7 non-zero values
    # Delayed with scale 2: 448 and 100 and -3 -> 896, 200, -6: one of 8 saturates; 2^-11
    # becomes 2^-10 and still flushes, 2^-10 becomes 2^-9 and survives.
    stats = fp8_tensor_stats(x, recipe="delayed", role="input", scale=torch.tensor(2.0))
    assert stats.scale == 2.0
    assert stats.saturated_fraction == 1 / 8
    assert stats.underflow_fraction == 1 / 7


def test_block_scale_summary():
    x = torch.ones(2, 64)
    x[0, :32] = 448.0  # mxfp8 cell scale 1; the other three cells have amax 1: scale 256
    x[1, 0] = 2.0**-20  # 2^-20 * 256 = 2^-12 <= 2^-10: flushes
    stats = fp8_tensor_stats(x, recipe="mxfp8", role="input")
    assert (stats.scale_min, stats.scale, stats.scale_max, stats.num_scales) == (1.0, 256, 256, 4)
    assert stats.underflow_fraction == 1 / 128


def test_delayed_needs_scale():
    with pytest.raises(ValueError, match="pass scale="):
        fp8_tensor_stats(torch.ones(4, 4), recipe="delayed", role="input")


def test_vector_without_sync_reads_back_to_the_same_stats():
    x = _wide_range_tensor(seed=3)
    vector = fp8_stats_vector(x, recipe="blockwise", role="weight")
    assert vector.dtype == torch.float64 and vector.shape == (len(STATS_FIELDS),)
    fields = dict(zip(STATS_FIELDS, vector.tolist()))
    assert fields["num_scales"] == 4  # 256 x 256 in 128 x 128 cells
    assert fields["nonzero"] == 65531 and fields["amax"] == 3000.0
    stats = stats_from_vector(
        vector.tolist(), recipe="blockwise", role="weight", fp8_format="hybrid", numel=x.numel()
    )
    assert stats == fp8_tensor_stats(x, recipe="blockwise", role="weight")
    assert stats.underflow_fraction == fields["flushed"] / 65531


@pytest.mark.parametrize(
    "role, values, saturated",
    [
        ("input", [448.0, 460.0, 464.0, 464.5, 500.0], [False, False, False, True, True]),
        ("grad", [57344.0, 61439.0, 61440.0, 70000.0], [False, False, True, True]),
    ],
)
def test_saturated_means_the_clamp_changed_the_value(role, values, saturated):
    # Delayed at scale 1: the count is of the values that round past the format's max, i.e.
    # where the clamp to max changes the byte. Rounded to the format's precision with no range
    # limit (a quarter of the value is in range, cast by torch, times 4), the same ones do.
    fp8_dtype = E5M2 if role == "grad" else E4M3
    x = torch.tensor([values])
    rounded = (x / 4).to(fp8_dtype).float() * 4
    assert (rounded[0] > FORMAT[fp8_dtype][0]).tolist() == saturated  # torch's rounding agrees
    stats = fp8_tensor_stats(x, recipe="delayed", role=role, scale=torch.tensor(1.0))
    assert stats.saturated_fraction == sum(saturated) / len(values)


def test_an_amax_rounded_one_ulp_past_max_is_not_saturated():
    # 448 / 4.84375 rounds up in fp32: the amax scales to 448.00003, whose byte is 448's anyway.
    x = torch.tensor([[4.84375, 1.0, -2.0, 0.5]])
    stats = fp8_tensor_stats(x, recipe="tensorwise", role="input")
    scaled = torch.tensor(4.84375) * torch.tensor(stats.scale, dtype=torch.float32)
    assert scaled.item() > 448.0  # the case: past max by less than half an ulp
    assert stats.saturated_fraction == 0.0


def test_all_zero_cells_are_left_out_of_the_scale_summary():
    x = torch.zeros(8, 128)
    x[0], x[1], x[2] = 1.0, 2.0, 448.0  # 1x128 cells: scales 256, 128, 1 (power of 2)
    stats = fp8_tensor_stats(x, recipe="blockwise", role="input")
    assert (stats.scale_min, stats.scale, stats.scale_max, stats.num_scales) == (1.0, 128, 256, 3)
    stats = fp8_tensor_stats(torch.zeros(4, 128), recipe="blockwise", role="input")
    assert stats.num_scales == 4 and stats.scale == 1.0  # nothing but zeros: the scales used
