"""Bitwise self-check of `quantize_cuda` against the reference quantizer (zero tolerance).

A test harness, not library code: shared by tests/unit_tests/fp8/test_cuda_quantize.py (GPU),
its CPU twin test_cuda_fallback.py and `benchmarks/bench_fp8.py --check`, so that the GPU run
and the unit tests exercise the same inputs: random tensors of awkward shapes plus every edge
case listed in docs/FP8_NUMERICS.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from megatron.core.fp8.cuda.quantize import quantize_cuda
from megatron.core.fp8.formats import fp8_max

# Shapes: block-aligned, ragged in one or both dims (rows a multiple of 4 or not: the word
# kernels need one), ragged rows with whole 128-column blocks (the MX kernel's packed E8M0
# words), one row, one column, and 3-D.
CHECK_SHAPES = (
    (256, 384),
    (132, 300),
    (130, 300),
    (70, 512),
    (1, 77),
    (257, 1),
    (33, 32),
    (2, 3, 160),
)
CHECK_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
CHECK_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
CHECK_INPUT_DTYPES = (torch.bfloat16, torch.float32)
_KEYS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")


@dataclass(frozen=True, kw_only=True)
class CheckCase:
    name: str
    x: torch.Tensor
    recipe: str
    fp8_dtype: torch.dtype
    role: str
    power_2_scale: bool | None
    scale: torch.Tensor | None = None


def edge_case_inputs(*, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Named [rows, cols] tensors covering the edge cases of docs/FP8_NUMERICS.md."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    small = torch.randn(130, 300, generator=gen)
    cases = {"all_zero": torch.zeros(130, 300)}
    zero_block = torch.randn(256, 256, generator=gen)
    zero_block[:128, :128] = 0.0  # one all-zero 128x128 block, 1x128 rows and 32-blocks too
    cases["zero_block"] = zero_block
    huge = small.clone()
    huge[5, 7] = 1e30  # one huge value squeezes the others towards zero / subnormals
    cases["one_huge"] = huge
    tiny = torch.full((64, 96), 1e-40)  # fp32 subnormal; also representable in bf16
    tiny[1::2] = torch.randn(32, 96, generator=gen) * 1e-38
    cases["subnormal"] = tiny
    specials = small.clone()
    specials[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan")])
    specials[129, 299] = float("nan")
    cases["inf_nan"] = specials
    cases["all_nan_block"] = torch.where(torch.arange(300) < 128, float("nan"), small)
    cases["ties"] = _round_to_even_ties()
    return {name: x.to(dtype).to(device) for name, x in cases.items()}


def _round_to_even_ties() -> torch.Tensor:
    """Midpoints between neighbouring E4M3 values (and their negatives) next to 448: with
    scale 1 they only round right under round-to-nearest-even."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([midpoints, -midpoints, torch.tensor([448.0, 464.0, 480.0, 1e9])])
    return row.repeat(4, 1)


def saturation_inputs(
    *, scale: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Values at and just above fp8_max / scale for both formats (delayed scaling with this
    scale must saturate the ones above to +-max)."""
    rows = []
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        at = torch.tensor(fp8_max(fp8_dtype) / scale, dtype=torch.float32)
        above = torch.nextafter(at, torch.tensor(float("inf")))
        rows.append(torch.stack([at, above, at * 1.03, -at, -above, at * 1e6, at / 3]))
    return torch.cat(rows).repeat(3, 5).to(dtype).to(device)


def check_cases(
    device: torch.device | str,
    *,
    recipes: tuple[str, ...] = CHECK_RECIPES,
    fp8_dtypes: tuple[torch.dtype, ...] = CHECK_FORMATS,
    quick: bool = False,
) -> list[CheckCase]:
    """Every (input, recipe, format, role) combination the self-check runs. `quick` (the
    benchmark's --check) keeps bf16 inputs, three shapes and the recipe-default scale options,
    which bounds the number of Triton specializations to compile."""
    cases = []
    input_dtypes = CHECK_INPUT_DTYPES[:1] if quick else CHECK_INPUT_DTYPES
    shapes = CHECK_SHAPES[:3] if quick else CHECK_SHAPES
    for dtype in input_dtypes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        inputs = {
            f"randn{tuple(s)}": (torch.randn(*s, generator=gen) * 3).to(dtype).to(device)
            for s in shapes
        }
        inputs.update(edge_case_inputs(dtype=dtype, device=device))
        inputs["saturation"] = saturation_inputs(scale=2.0, dtype=dtype, device=device)
        for (name, x), recipe, fp8_dtype in itertools.product(inputs.items(), recipes, fp8_dtypes):
            cases.extend(_cases_for(name, x, recipe, fp8_dtype, quick=quick))
    return cases


def _cases_for(name, x, recipe, fp8_dtype, *, quick):
    label = f"{name}/{x.dtype}/{recipe}/{fp8_dtype}"
    if recipe == "delayed":
        # 1.0 keeps the ties input on exact ties; 2.0 is what saturation_inputs is built for;
        # 0.37 has an inexact reciprocal; 3e38 pushes every product to saturation or Inf.
        scales = (1.0, 2.0) if quick else (1.0, 2.0, 0.37, 3.0e38)
        return [
            CheckCase(
                name=f"{label}/scale={s}",
                x=x,
                recipe=recipe,
                fp8_dtype=fp8_dtype,
                role="input",
                power_2_scale=None,
                scale=torch.tensor(s, device=x.device),
            )
            for s in scales
        ]
    roles = ("input", "weight") if recipe == "blockwise" else ("input",)
    pow2_options = (None,) if recipe == "mxfp8" or quick else (True, False)
    return [
        CheckCase(
            name=f"{label}/{role}/pow2={p}",
            x=x,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role=role,
            power_2_scale=p,
        )
        for role, p in itertools.product(roles, pow2_options)
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern for a bitwise comparison (NaN == NaN when the bits agree)."""
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t.contiguous().view(torch.uint8)


def _mismatch(key: str, got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    if (got is None) != (want is None):
        return f"{key}: got {'None' if got is None else 'a tensor'}, want the other"
    if got is None:
        return None
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{key}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    differ = _bits(got) != _bits(want)
    if not bool(differ.any()):
        return None
    first = tuple(int(i) for i in differ.nonzero()[0])
    return (
        f"{key}: {int(differ.sum())} of {differ.numel()} differ, first at {first}: "
        f"got {got[first].item()!r} want {want[first].item()!r}"
    )


def compare_case(case: CheckCase, *, with_transpose: bool = True) -> list[str]:
    """Mismatches between quantize_cuda and the reference for one case (empty: bitwise equal)."""
    from megatron.core.fp8 import quantize  # the public API; imported late to avoid a cycle

    kwargs = dict(
        recipe=case.recipe,
        fp8_dtype=case.fp8_dtype,
        role=case.role,
        rowwise=True,
        columnwise=True,
        scale=case.scale,
    )
    want = quantize(case.x, power_2_scale=case.power_2_scale, backend="reference", **kwargs)
    pow2 = case.power_2_scale
    if pow2 is None:
        pow2 = case.recipe in ("blockwise", "mxfp8")
    got = quantize_cuda(case.x, power_2_scale=pow2, with_transpose=with_transpose, **kwargs)
    problems = [_mismatch(key, got[key], getattr(want, key)) for key in _KEYS]
    if with_transpose:
        rows2d = want.columnwise_data.reshape(-1, case.x.shape[-1])
        problems.append(_mismatch("columnwise_data_t", got["columnwise_data_t"], rows2d.t()))
    return [f"{case.name}: {p}" for p in problems if p is not None]


def compare_case_both_ways(case: CheckCase) -> list[str]:
    """compare_case with and without the transposed copy: the kernels differ (the MX copies
    without a transpose and the blockwise ones with it come from their own kernels)."""
    return compare_case(case) + compare_case(case, with_transpose=False)


def run_selfcheck(device: torch.device | str, *, quick: bool = False) -> tuple[int, list[str]]:
    """(number of cases, mismatch messages) over all check cases on `device`, each with and
    without the transposed copy."""
    failures = []
    cases = check_cases(device, quick=quick)
    for case in cases:
        failures.extend(compare_case_both_ways(case))
    return len(cases), failures
