"""Reference quantizers vs an independent numpy model and hand-computed bytes
(docs/FP8_NUMERICS.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron.core.fp8 import E4M3, E5M2, compute_scale, quantize
from megatron.core.fp8.formats import e8m0_from_t, e8m0_to_fp32
from tests.unit_tests.fp8 import fp8_numpy_model as model

FMT_NAME = {E4M3: "e4m3", E5M2: "e5m2"}
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FLT_MAX = float(np.finfo(np.float32).max)


def edge_tensor(rows: int, cols: int, *, seed: int = 0) -> torch.Tensor:
    """Random data at mixed magnitudes plus every edge case of docs/FP8_NUMERICS.md."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    magnitude = 10.0 ** torch.randint(-6, 6, (rows, 1), generator=gen).float()
    x = x * magnitude
    flat = x.view(-1)
    n = flat.numel()
    specials = [1e30, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 448.0, 464.0]
    for k, value in enumerate(specials):
        flat[(k * 37 + 5) % n] = value
    x[0, :] = 0.0  # an all-zero row (and all-zero 1xB blocks)
    if rows > 2:
        x[rows - 1, :] = 1e-40  # a row of fp32 subnormals
    return x


def to_np(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float32).numpy()


def assert_bytes(actual: torch.Tensor, expected: np.ndarray) -> None:
    mismatch = (actual.numpy() != expected).sum()
    assert mismatch == 0, f"{mismatch} bytes differ"


def assert_scales(actual: torch.Tensor, expected: np.ndarray) -> None:
    expected = np.atleast_1d(np.asarray(expected))
    actual_np = np.atleast_1d(actual.numpy())
    assert actual_np.dtype == expected.dtype
    np.testing.assert_array_equal(actual_np.view(np.uint8), expected.view(np.uint8))


# ---- formats and E8M0 --------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_saturating_cast_bytes_by_hand(fp8_dtype):
    is_e4m3 = fp8_dtype == E4M3
    values = [448.0, 464.0, 1e30, float("inf"), -float("inf"), float("nan"), 57344.0, 0.0, -0.0]
    qt = quantize(
        torch.tensor(values),
        recipe="delayed",
        fp8_dtype=fp8_dtype,
        role="input",
        scale=torch.tensor(1.0),
    )
    max_code = 0x7E if is_e4m3 else 0x7B
    # 448 is E4M3's max; 464 and above saturate; +-Inf saturates; NaN stays NaN (0x7F).
    expected = [
        0x7E if is_e4m3 else 0x5F,
        0x7E if is_e4m3 else 0x5F,
        max_code,
        max_code,
        0x80 | max_code,
        0x7F,
        max_code,
        0x00,
        0x80,
    ]
    assert qt.rowwise_data.tolist() == expected
    assert qt.rowwise_scale_inv.item() == 1.0
    assert qt.amax.item() == math.inf  # NaN ignored, Inf counts


def test_e8m0_rule_cases():
    cases = {
        1.0: 127,  # exact power of two: E
        1.5: 128,  # E + 1
        2.0**-127: 0,  # subnormal, m == 0x400000: byte 0 already means 2^-127
        float(model.from_bits(0x400001)): 1,  # subnormal, m > 0x400000: E + 1
        2.0**-149: 0,  # smallest subnormal
        float(model.from_bits(0x00800001)): 2,  # smallest normal above 2^-126
        2.0**127: 254,  # E == 254, m == 0
        FLT_MAX: 254,  # E == 254, m > 0: no rounding up into NaN
        float("inf"): 254,
        float("nan"): 255,
        0.0: 0,
    }
    t = torch.tensor(list(cases), dtype=torch.float32)
    assert e8m0_from_t(t).tolist() == list(cases.values())
    assert [model.e8m0(np.float32(v)) for v in cases] == list(cases.values())


def test_e8m0_multipliers_are_exact_powers_of_two():
    e = torch.tensor([0, 1, 127, 253, 254, 255], dtype=torch.uint8)
    dequant = e8m0_to_fp32(e)
    quant = e8m0_to_fp32(e, negate_exponent=True)
    assert dequant[:5].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**126, 2.0**127]
    assert quant[:5].tolist() == [2.0**127, 2.0**126, 1.0, 2.0**-126, 2.0**-127]
    assert dequant[5].isnan() and quant[5].isnan()
    assert model.bits(quant[4].item()) == 0x400000  # 2^-127 as an fp32 subnormal


# ---- per-tensor recipes ------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(5, 40), (1, 17), (23, 1)])
def test_tensorwise_matches_model(fp8_dtype, pow2, shape):
    x = edge_tensor(*shape).clamp(-1e4, 1e4)  # keep amax finite so the scale is not 1.0
    x[x.isnan()] = 0
    fmt = FMT_NAME[fp8_dtype]
    qt = quantize(
        x,
        recipe="tensorwise",
        fp8_dtype=fp8_dtype,
        role="input",
        columnwise=True,
        power_2_scale=pow2,
    )
    amax = model.nan_free_amax(to_np(x))
    scale = model.current_scale(amax, fmt, pow2, FLT_MAX)
    assert qt.amax.item() == float(amax)
    assert_scales(qt.rowwise_scale_inv, np.float32(1.0) / scale)
    assert_bytes(qt.rowwise_data, model.encode(to_np(x) * scale, fmt))
    assert torch.equal(qt.columnwise_data, qt.rowwise_data)


def test_tensorwise_guards_by_hand():
    fp8 = E4M3
    zeros = quantize(torch.zeros(3, 4), recipe="tensorwise", fp8_dtype=fp8, role="input")
    assert zeros.rowwise_scale_inv.item() == 1.0 and zeros.rowwise_data.sum().item() == 0
    with_inf = quantize(
        torch.tensor([[1.0, float("inf")]]), recipe="tensorwise", fp8_dtype=fp8, role="input"
    )
    assert with_inf.rowwise_scale_inv.item() == 1.0  # amax Inf -> scale 1.0
    assert with_inf.rowwise_data.tolist() == [[0x38, 0x7E]]  # 1.0 = 0x38; Inf saturates
    # amax 1e-40 (subnormal): 448 / 1e-40 overflows fp32 -> FLT_MAX; 1/FLT_MAX is subnormal.
    tiny = quantize(torch.full((2, 2), 1e-40), recipe="tensorwise", fp8_dtype=fp8, role="input")
    assert tiny.rowwise_scale_inv.item() == float(np.float32(1.0) / np.float32(FLT_MAX))
    expected = model.encode(np.full((2, 2), np.float32(1e-40)) * np.float32(FLT_MAX), "e4m3")
    assert_bytes(tiny.rowwise_data, expected)
    pow2 = quantize(
        torch.full((2, 2), 1e-40),
        recipe="tensorwise",
        fp8_dtype=fp8,
        role="input",
        power_2_scale=True,
    )
    assert pow2.rowwise_scale_inv.item() == 2.0**-127  # FLT_MAX rounded down to 2^127
    # NaN is ignored by the amax: the scale comes from 2.0 alone.
    nan = quantize(
        torch.tensor([2.0, float("nan")]), recipe="tensorwise", fp8_dtype=fp8, role="input"
    )
    assert nan.rowwise_scale_inv.item() == float(np.float32(1.0) / np.float32(224.0))
    assert nan.rowwise_data.tolist() == [0x7E, 0x7F]


def test_delayed_at_and_above_fp8_max_times_scale():
    scale = torch.tensor(0.5)
    x = torch.tensor([896.0, 900.0, 960.0, -1e30, 1e-40, float("nan")], dtype=torch.bfloat16)
    qt = quantize(x, recipe="delayed", fp8_dtype=E4M3, role="input", scale=scale)
    # 896 * 0.5 = 448 exactly (max); 900 and 960 scale above 448 and saturate.
    assert qt.rowwise_data.tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x7F]
    assert qt.rowwise_scale_inv.item() == 2.0
    assert qt.amax.item() == float(torch.tensor(1e30, dtype=torch.bfloat16).float())
    third = quantize(
        torch.ones(2), recipe="delayed", fp8_dtype=E4M3, role="input", scale=torch.tensor(3.0)
    )
    assert third.rowwise_scale_inv.item() == float(np.float32(1.0) / np.float32(3.0))


def test_tensorwise_global_amax_argument():
    x = torch.tensor([[1.0, -2.0]])
    qt = quantize(x, recipe="tensorwise", fp8_dtype=E4M3, role="weight", amax=torch.tensor(4.0))
    assert qt.rowwise_scale_inv.item() == float(np.float32(4.0) / np.float32(448.0))
    # 112 = 1.75 * 2^6 -> exp field 13, mantissa 110; -224 = -1.75 * 2^7 -> exp field 14.
    assert qt.rowwise_data.tolist() == [[0x6E, 0xF6]]
    assert compute_scale(torch.tensor(4.0), recipe="tensorwise", fp8_dtype=E4M3).item() == 112.0


# ---- block recipes -----------------------------------------------------------------------

BLOCK_CASES = [
    # recipe, role, shape, columnwise
    ("blockwise", "input", (3, 300), False),
    ("blockwise", "grad", (130, 3), True),
    ("blockwise", "input", (1, 129), False),
    ("blockwise", "input", (129, 1), True),
    ("blockwise", "weight", (130, 200), False),
    ("blockwise", "weight", (1, 1), False),
    ("mxfp8", "input", (3, 70), False),
    ("mxfp8", "grad", (70, 5), True),
    ("mxfp8", "weight", (1, 33), False),
    ("mxfp8", "input", (33, 1), True),
]


def block_geometry(recipe, role, columnwise):
    block = 128 if recipe == "blockwise" else 32
    if recipe == "blockwise" and role == "weight":
        return block, block
    return (block, 1) if columnwise else (1, block)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("recipe", "role", "shape", "columnwise"), BLOCK_CASES)
def test_block_recipes_match_model(recipe, role, shape, columnwise, input_dtype, fp8_dtype):
    x = edge_tensor(*shape, seed=shape[0] * 7 + shape[1]).to(input_dtype)
    fmt = FMT_NAME[fp8_dtype]
    qt = quantize(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=not columnwise,
        columnwise=columnwise,
    )
    block_rows, block_cols = block_geometry(recipe, role, columnwise)
    data, scales = model.quantize_blocks(
        to_np(x),
        fmt,
        recipe,
        block_rows=block_rows,
        block_cols=block_cols,
        inf_value=BF16_MAX if input_dtype == torch.bfloat16 else FLT_MAX,
    )
    direction = "columnwise" if columnwise else "rowwise"
    assert getattr(qt, f"{direction}_data").shape == x.shape
    assert tuple(getattr(qt, f"{direction}_scale_inv").shape) == scales.shape
    assert_bytes(getattr(qt, f"{direction}_data"), data)
    assert_scales(getattr(qt, f"{direction}_scale_inv"), scales)


def test_blockwise_scale_shapes_and_hand_values():
    x = torch.zeros(2, 130)
    x[0, 0] = 3.0  # block (0,0) amax 3 -> 448/3 = 149.33 -> pow2 128 -> scale_inv 2^-7
    x[1, 129] = 1e-40  # block (1,1): 448/1e-40 overflows -> fp32 max -> pow2 2^127
    qt = quantize(x, recipe="blockwise", fp8_dtype=E4M3, role="input", columnwise=True)
    assert qt.rowwise_scale_inv.tolist() == [[2.0**-7, 1.0], [1.0, 2.0**-127]]
    assert qt.rowwise_data[0, 0].item() == 0x7C  # 3 * 128 = 384 = 1.5 * 2^8: exp 15, man 100
    assert tuple(qt.columnwise_scale_inv.shape) == (1, 130)
    assert qt.columnwise_scale_inv[0, 0].item() == 2.0**-7
    weight = quantize(torch.ones(129, 257), recipe="blockwise", fp8_dtype=E4M3, role="weight")
    assert tuple(weight.rowwise_scale_inv.shape) == (2, 3)
    assert weight.rowwise_scale_inv.unique().tolist() == [2.0**-8]  # 448 -> pow2 256


def test_blockwise_infinite_scale_uses_input_dtype_max_without_pow2():
    x = torch.full((1, 4), 1e-40)
    fp32 = quantize(x, recipe="blockwise", fp8_dtype=E4M3, role="input", power_2_scale=False)
    bf16 = quantize(
        x.bfloat16(), recipe="blockwise", fp8_dtype=E4M3, role="input", power_2_scale=False
    )
    assert fp32.rowwise_scale_inv.item() == float(np.float32(1) / np.float32(FLT_MAX))
    assert bf16.rowwise_scale_inv.item() == float(np.float32(1) / np.float32(BF16_MAX))


def test_mxfp8_hand_values():
    x = torch.zeros(32, 64)
    x[0, 0] = 448.0  # t = 448 * fp32(1/448): rounds to just above or at 1.0
    x[0, 40] = 1.0  # t = 1/448 = 2^-9 * 1.14 -> e = 127 - 8 = 119, multiplier 2^8
    qt = quantize(x, recipe="mxfp8", fp8_dtype=E4M3, role="input", columnwise=True)
    t = np.float32(448.0) * (np.float32(1.0) / np.float32(448.0))
    assert qt.rowwise_scale_inv[0].tolist() == [model.e8m0(t), 119]
    assert qt.rowwise_scale_inv[1].tolist() == [0, 0]  # all-zero blocks -> byte 0
    assert qt.rowwise_data[0, 40].item() == 0x78  # 1.0 * 2^8 = 256 = 2^8 in E4M3
    assert tuple(qt.columnwise_scale_inv.shape) == (1, 64)
    assert qt.columnwise_data.shape == x.shape


def test_bad_inputs_name_the_problem():
    x = torch.ones(2, 2)
    with pytest.raises(ValueError, match="recipe must be one of"):
        quantize(x, recipe="rowwise", fp8_dtype=E4M3, role="input")
    with pytest.raises(ValueError, match="pass scale="):
        quantize(x, recipe="delayed", fp8_dtype=E4M3, role="input")
    with pytest.raises(ValueError, match="role must be one of"):
        quantize(x, recipe="tensorwise", fp8_dtype=E4M3, role="activation")
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        quantize(x, recipe="tensorwise", fp8_dtype=torch.float16, role="input")
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        quantize(x.double(), recipe="tensorwise", fp8_dtype=E4M3, role="input")
    with pytest.raises(ValueError, match="only for 'tensorwise'"):
        quantize(x, recipe="mxfp8", fp8_dtype=E4M3, role="input", amax=torch.tensor(1.0))
