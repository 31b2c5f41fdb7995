"""fp8_stats_vector's chunked passes (issue 41: cheap enough to leave on) equal the formulas it
replaced, kept here as the reference: full-size fp32 x times the expanded scale grid for the
saturated count, a real `quantize` + dequantize for the flushed count. Edge values: NaN, zeros,
saturating (delayed) values, subnormals, and tensors whose shapes are not whole cells or
chunks. Temporaries stay bounded by CHUNK_ELEMENTS (measured per op)."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core import fused_pass
from megatron.core.fp8 import stats as stats_module
from megatron.core.fp8.formats import E4M3, E5M2, fp8_dtype_for_role, fp8_max
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import block_scales, expand_grid
from megatron.core.fp8.stats import (
    CHUNK_ELEMENTS,
    STATS_FIELDS,
    fp8_stats_vector,
    fp8_tensor_stats,
    row_chunks,
)

RECIPES = ("tensorwise", "blockwise", "mxfp8", "delayed")
ROLES = ("input", "weight", "grad")


def old_stats_vector(x, *, recipe, role, scale=None, amax=None):
    """The formulas fp8_stats_vector used before the chunked passes (NaN as 0 in amaxes), with
    session 46's two rules (saturation where the clamp changes a value; no all-zero cells in the
    scale summary)."""
    spec = recipe_spec(recipe)
    fp8_dtype = fp8_dtype_for_role("hybrid", role)
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
    cell = spec.block_shape(role, columnwise=False) or tuple(x2d.shape)
    magnitude = torch.nan_to_num(x2d.abs(), nan=0.0)
    rows, cols = x2d.shape
    grid_rows, grid_cols = -(-rows // cell[0]), -(-cols // cell[1])
    padded = F.pad(magnitude, (0, grid_cols * cell[1] - cols, 0, grid_rows * cell[0] - rows))
    cell_amax = padded.reshape(grid_rows, cell[0], grid_cols, cell[1]).amax(dim=(1, 3))
    if spec.delayed:
        grid = scale.to(torch.float32).reshape(1, 1)
    else:
        grid, _ = block_scales(
            cell_amax if amax is None else amax.reshape(1, 1),
            spec=spec,
            fp8_dtype=fp8_dtype,
            power_2_scale=spec.resolve_power_2_scale(None),
            input_dtype=x.dtype,
        )
    scaled = x2d * expand_grid(grid, cell, x2d.shape)
    q = quantize(x, recipe=recipe, fp8_dtype=fp8_dtype, role=role, scale=scale, amax=amax)
    dequantized = q.dequantize(torch.float32).reshape(x2d.shape)
    nonzero = x2d != 0
    flat = grid.reshape(-1)
    if (cell_amax > 0).any():  # the scale summary leaves all-zero cells out (since session 46)
        flat = flat[cell_amax.reshape(-1) > 0]
    parts = [magnitude.amax(), flat.median(), flat.amin(), flat.amax()]
    # Saturated: the values that round past max (the clamp changes them; since session 46):
    # E4M3 past 448 + 16, E5M2 from 57344 + 4096 on (round-to-nearest-even ties go up there).
    largest = fp8_max(fp8_dtype)
    saturated = scaled.abs() > 464.0 if largest == 448.0 else scaled.abs() >= 61440.0
    parts += [torch.tensor(flat.numel(), device=x.device), saturated.sum()]
    parts += [(nonzero & (dequantized == 0)).sum(), nonzero.sum()]
    return torch.stack([part.to(torch.float64) for part in parts])


def _edge_tensor(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over 2^-40 .. 2^12 (subnormal after scaling, and above E4M3's max at scale 1),
    exact zeros (whole cells of them too), NaNs and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-40, 13, (rows, cols), generator=gen).to(torch.float32)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(exponent)
    x[torch.rand(rows, cols, generator=gen) < 0.05] = 0.0
    x[1, :] = 0.0  # a row of all-zero cells: scale 1
    x[2, 3], x[5, 7], x[0, 0] = float("nan"), -0.0, float("nan")
    x[4, 10] = 1.0e6  # saturates E4M3 and E5M2 at the delayed scales tested (>= 1/8)
    return x.to(dtype)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4096 elements: the test tensors span many chunks and a partial last one."""
    monkeypatch.setattr(stats_module, "row_chunks", functools.partial(row_chunks, limit=4096))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("shape", [(512, 256), (300, 200)])
def test_chunked_equals_old_formulas(small_chunks, recipe, role, shape):
    for dtype, scale in ((torch.bfloat16, 2.0**-3), (torch.float32, 4.0)):
        x = _edge_tensor(*shape, dtype, seed=shape[1])
        scale = torch.tensor(scale) if recipe == "delayed" else None
        new = fp8_stats_vector(x, recipe=recipe, role=role, scale=scale)
        old = old_stats_vector(x, recipe=recipe, role=role, scale=scale)
        assert new.tolist() == old.tolist()
        fields = dict(zip(STATS_FIELDS, new.tolist()))
        assert fields["nonzero"] > fields["flushed"] > 0
        if recipe == "delayed":
            assert fields["saturated"] >= 1


def test_chunked_given_global_amax_equals_old_formulas(small_chunks):
    x = _edge_tensor(300, 200, torch.bfloat16, seed=5)
    amax = torch.tensor(1.0e6)  # the other shards' amax is larger: underflows grow
    new = fp8_stats_vector(x, recipe="tensorwise", role="input", amax=amax)
    old = old_stats_vector(x, recipe="tensorwise", role="input", amax=amax)
    assert new.tolist() == old.tolist()
    assert new[STATS_FIELDS.index("amax")] < 1.0e6


@pytest.mark.parametrize("recipe", ("tensorwise", "blockwise"))
def test_infinity_scales_as_quantize_does(recipe):
    """An inf makes quantize's scale 1 (an unusable amax); the old formulas turned the inf into
    FLT_MAX first (a scale near 1e-36 saturating nothing but the inf). Now the amax, scale and
    saturated count follow quantize: the inf, 500 and -1000 saturate (to +-448)."""
    x = torch.ones(4, 128)
    x[0, 0], x[0, 1], x[0, 2] = float("inf"), 500.0, -1000.0
    q = quantize(x, recipe=recipe, fp8_dtype=E4M3, role="input").dequantize(torch.float32)
    assert q[0, :3].tolist() == [448.0, 448.0, -448.0]
    stats = fp8_tensor_stats(x, recipe=recipe, role="input")
    assert stats.amax == float("inf") and stats.scale_min == 1.0
    assert stats.saturated_fraction == 3 / 512
    assert stats.underflow_fraction == 0.0
    old = old_stats_vector(x, recipe=recipe, role="input").tolist()
    assert old[STATS_FIELDS.index("saturated")] == 1  # the old formulas: only the inf


def test_row_chunks_bound_the_temporaries_of_model_a_operands():
    # Model A: [8192, 4096] and [8192, 14336] activations, grads and weights, every cell shape.
    for rows, cols in ((8192, 4096), (8192, 14336), (14336, 4096), (4096, 14336), (3, 5)):
        for cell_rows in (1, 128):
            chunks = row_chunks(rows, cols, cell_rows)
            assert chunks[0][0] == 0 and chunks[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
            assert all((stop - start) * cols <= CHUNK_ELEMENTS for start, stop in chunks)
            assert all(start % cell_rows == 0 for start, _ in chunks)
    assert CHUNK_ELEMENTS * 4 == 64 * 2**20  # an fp32 chunk is 64 MiB


class _LargestAllocation(TorchDispatchMode):
    """The largest new storage any op makes (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        known = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("role", ROLES)
def test_no_temporary_larger_than_a_chunk(monkeypatch, recipe, role):
    chunk = 1 << 15
    monkeypatch.setattr(stats_module, "row_chunks", functools.partial(row_chunks, limit=chunk))
    x = torch.randn(1024, 1024, dtype=torch.bfloat16)  # 2 MiB; in fp32 4 MiB
    scale = torch.tensor(1.0) if recipe == "delayed" else None
    with _LargestAllocation() as mode:
        fp8_stats_vector(x, recipe=recipe, role=role, scale=scale)
    # One fp32 chunk (128 KiB); blockwise weights: one row of 128 x 128 cells (512 KiB).
    cell_rows = 128 if (recipe, role) == ("blockwise", "weight") else 1
    assert mode.largest <= 4 * max(chunk, cell_rows * 1024)
    assert mode.largest <= x.numel() * 4 // 8  # an eighth of x in fp32


def test_e5m2_grad_counts_with_small_chunks(small_chunks):
    x = _edge_tensor(256, 96, torch.bfloat16, seed=9)
    stats = fp8_tensor_stats(x, recipe="mxfp8", role="grad")
    assert stats.fp8_dtype == str(E5M2).removeprefix("torch.")
    old = old_stats_vector(x, recipe="mxfp8", role="grad").tolist()
    assert stats.underflow_fraction == old[STATS_FIELDS.index("flushed")] / old[-1]


def test_fused_passes_equal_eager(small_chunks, monkeypatch):
    """The torch.compile'd chunk passes (CUDA in training; compiled on CPU here) give the
    eager counts bit for bit, under force_eager as on a statistics step."""
    x = _edge_tensor(300, 200, torch.bfloat16, seed=11)
    cases = (("mxfp8", "grad", None), ("delayed", "input", torch.tensor(0.125)))
    eager = [fp8_stats_vector(x, recipe=r, role=role, scale=s).tolist() for r, role, s in cases]
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: True)
    torch._dynamo.reset()
    counters.clear()
    with torch.compiler.set_stance("force_eager"):
        fused = [fp8_stats_vector(x, recipe=r, role=role, scale=s).tolist() for r, role, s in cases]
    assert fused == eager
    assert counters["stats"]["unique_graphs"] >= 4  # both passes compiled, for both cases
    assert eager[1][STATS_FIELDS.index("saturated")] >= 1


def test_a_failed_fused_compile_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: True)

    def breaks(chunk: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True: the compile raises
        return chunk.sum()

    run = fused_pass.fused(breaks)
    with pytest.warns(UserWarning, match="breaks runs eagerly, compile failed"):
        assert run(torch.ones(3)).item() == 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(torch.ones(4)).item() == 4.0  # eager from then on, no second warning


def test_a_failed_compile_warning_names_the_hidden_cause(monkeypatch):
    # torch 2.11 on the H100 reported only "Hard failure due to fullgraph=True" (session 42):
    # the warning carries the chained exception that says why.
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: True)

    def hard_failure(*args, **kwargs):
        try:
            raise ValueError("guard on cell (1, 64) failed")
        except ValueError as reason:
            raise RuntimeError("Hard failure due to fullgraph=True") from reason

    monkeypatch.setattr(torch, "compile", lambda fn, **options: hard_failure)
    run = fused_pass.fused(lambda chunk: chunk.sum())
    with pytest.warns(UserWarning) as caught:
        assert run(torch.ones(3)).item() == 3.0
    assert str(caught[0].message).endswith(
        "compile failed: Hard failure due to fullgraph=True (guard on cell (1, 64) failed)"
    )


def test_every_recipe_in_one_process_keeps_the_fused_passes(monkeypatch):
    # One process, every recipe and role, bf16 and fp32, a one-row tensor: more graphs than
    # Dynamo's default recompile limit (8), which made the passes fall back on the H100
    # (session 42). Dynamo's eager backend keeps the compiles cheap; the values equal eager.
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real_compile, backend="eager"))
    for name in ("_chunk_amax", "_chunk_counts"):
        fused_fn = fused_pass.fused(getattr(stats_module, name).__wrapped__)
        monkeypatch.setattr(stats_module, name, fused_fn)
    seeded = torch.Generator().manual_seed
    cases = [
        (recipe, role, torch.randn(rows, 256, dtype=dtype, generator=seeded(rows)))
        for recipe in ("tensorwise", "blockwise", "delayed", "mxfp8")
        for role in ("input", "weight", "grad")
        for dtype in (torch.float32, torch.bfloat16)
        for rows in (1, 130)
    ]  # fmt: skip
    scale = {"delayed": torch.tensor(2.0)}

    def vectors():
        return [
            fp8_stats_vector(x, recipe=r, role=role, scale=scale.get(r)).tolist()
            for r, role, x in cases
        ]

    eager = vectors()
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: True)
    torch._dynamo.reset()
    counters.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a fallback warns: the test fails
            fused = vectors()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert fused == eager
    assert graphs > 8  # Dynamo's default recompile limit
