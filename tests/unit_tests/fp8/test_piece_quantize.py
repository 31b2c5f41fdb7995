"""Weight pieces (the flat ranges a data-parallel rank holds): partial cell amaxes and bytes.

A weight cut into pieces at arbitrary flat offsets (mid-row, mid-block), its pieces' cell
amaxes max-combined and each piece cast with the resulting multipliers, equals `quantize()` of
the whole weight bit for bit. The CPU tests run the torch twin; the gpu-marked ones run the
Triton kernels and compare them bitwise with the twin on the same pieces, edge values included.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8 import quantize
from megatron.core.fp8.cuda import piece_quantize as pq
from megatron.core.fp8.formats import e8m0_to_fp32
from megatron.core.fp8.quantization import compute_scale
from megatron.core.fp8.recipe import recipe_spec
from megatron.core.fp8.reference import reciprocal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
# Ragged and tiny shapes too: rows/cols not multiples of 32 or 128, one row, one column.
SHAPES = ((256, 384), (200, 136), (130, 96), (1, 160), (96, 1))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat bytes of any tensor (0-d scales included) for a bitwise comparison."""
    return t.reshape(-1).view(torch.uint8)


def _weight(shape, *, seed: int, device: str, edges: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    if edges:
        flat = x.view(-1)
        n = flat.numel()
        picks = torch.randperm(n, generator=generator)[:6].tolist()
        for index, value in zip(
            picks, [float("nan"), float("inf"), -float("inf"), 1e30, 1e-40, -448.0 * 2]
        ):
            flat[index] = value
        if x.shape[0] >= 32 and x.shape[1] >= 32:
            x[:32, :32] = 0.0  # an all-zero block in every recipe's grid
    return x.to(device)


def _cuts(numel: int, *, pieces: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    inner = torch.randperm(max(numel - 1, 1), generator=generator)[: pieces - 1] + 1
    return [0, *sorted(set(inner.tolist()) - {numel}), numel]


def _directions(recipe: str) -> tuple[bool, ...]:
    return (False, True) if recipe == "mxfp8" else (False,)


def _multiplier(recipe, amax, *, fp8_dtype, delayed_scale):
    """(quantize multiplier, scale_inv) per cell, as fp8_storage derives them."""
    if recipe == "delayed":
        return delayed_scale, reciprocal(delayed_scale)
    if recipe == "mxfp8":
        e8m0 = compute_scale(amax, recipe="mxfp8", fp8_dtype=fp8_dtype)
        return e8m0_to_fp32(e8m0, negate_exponent=True), e8m0
    scale = compute_scale(amax, recipe=recipe, fp8_dtype=fp8_dtype, input_dtype=torch.float32)
    return scale, reciprocal(scale)


def _quantize_in_pieces(x, *, recipe, fp8_dtype, cuts, delayed_scale, cell_rows=None):
    """{columnwise: (bytes [M, K], scale_inv grid, amax grid)} from the pieces of x."""
    shape, flat = x.shape, x.reshape(-1)
    results = {}
    for columnwise in _directions(recipe):
        grid = pq.grid_dims(shape, recipe=recipe, columnwise=columnwise, cell_rows=cell_rows)
        amax = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=x.device)
        for lo, hi in zip(cuts, cuts[1:]):
            pq.piece_cell_amax_(
                flat[lo:hi],
                amax,
                shape=shape,
                spec=recipe_spec(recipe),
                columnwise=columnwise,
                param_start=lo,
                cell_rows=cell_rows,
            )
        multiplier, scale_inv = _multiplier(
            recipe, amax, fp8_dtype=fp8_dtype, delayed_scale=delayed_scale
        )
        data = torch.full((flat.numel(),), 0xAA, dtype=torch.uint8, device=x.device)
        for lo, hi in zip(cuts, cuts[1:]):
            pq.piece_cast_(
                flat[lo:hi],
                multiplier,
                data[lo:hi],
                shape=shape,
                spec=recipe_spec(recipe),
                columnwise=columnwise,
                param_start=lo,
                fp8_dtype=fp8_dtype,
                cell_rows=cell_rows,
            )
        results[columnwise] = (data.view(shape), scale_inv, amax)
    return results


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_pieces_equal_whole_weight_quantize(recipe, fp8_dtype):
    checked = 0
    for index, shape in enumerate(SHAPES):
        x = _weight(shape, seed=index, device="cpu", edges=True)
        delayed_scale = torch.tensor(37.5, dtype=torch.float32)
        want = quantize(
            x,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role="weight",
            rowwise=True,
            columnwise=recipe == "mxfp8",
            scale=delayed_scale if recipe == "delayed" else None,
        )
        for pieces in (1, 3, 7):
            cuts = _cuts(x.numel(), pieces=pieces, seed=10 * index + pieces)
            got = _quantize_in_pieces(
                x, recipe=recipe, fp8_dtype=fp8_dtype, cuts=cuts, delayed_scale=delayed_scale
            )
            for columnwise, (data, scale_inv, _) in got.items():
                prefix = "columnwise" if columnwise else "rowwise"
                assert torch.equal(data, getattr(want, f"{prefix}_data")), (shape, cuts)
                want_scale = getattr(want, f"{prefix}_scale_inv")
                assert torch.equal(_bytes(scale_inv), _bytes(want_scale)), (shape, cuts)
                checked += 1
    assert checked == len(SHAPES) * 3 * len(_directions(recipe))


STACKED = {"tensorwise": (4, 64, 136), "delayed": (3, 96, 40), "blockwise": (3, 256, 200)}
"""Stacked expert weights [E, N, K] whose N a one-pass cell tiles (K ragged)."""


def _stacked_reference(x, recipe, fp8_dtype, delayed_scales):
    """Each expert quantized alone, bytes and scales stacked (what the engine must store)."""
    parts = [
        quantize(
            x[e],
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role="weight",
            scale=delayed_scales[e] if recipe == "delayed" else None,
        )
        for e in range(x.shape[0])
    ]
    return torch.stack([p.rowwise_data for p in parts]), torch.stack(
        [p.rowwise_scale_inv for p in parts]
    )


def _stacked_in_one_pass(x, recipe, fp8_dtype, delayed_scales, *, seed):
    """x [E, N, K] cut at random flat offsets (mid-expert, mid-row), each piece written with
    `stacked_cell_rows`: (bytes [E, N, K], scale_inv [E * cells], amax)."""
    cell_rows = pq.stacked_cell_rows(x.shape, recipe_spec(recipe))
    cuts = _cuts(x.numel(), pieces=5, seed=seed)
    got = _quantize_in_pieces(
        x, recipe=recipe, fp8_dtype=fp8_dtype, cuts=cuts, delayed_scale=delayed_scales,
        cell_rows=cell_rows,
    )[False]  # fmt: skip
    return got[0].view(x.shape), got[1], got[2]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", sorted(STACKED))
def test_stacked_experts_in_one_pass_equal_each_expert_quantized(recipe, fp8_dtype):
    """A stacked weight's pieces written with cells of `stacked_cell_rows` rows (per-tensor:
    N, one cell per expert, each expert's delayed scale; blockwise: 128, none straddling two
    experts): the bytes and scales of each expert quantized alone, bit for bit."""
    experts, n, k = STACKED[recipe]
    generator = torch.Generator().manual_seed(3)
    magnitudes = torch.tensor([0.01, 7.0, 300.0, 1.0][:experts]).view(experts, 1, 1)
    x = torch.randn(experts, n, k, generator=generator) * magnitudes
    x[1, 5, 7] = float("nan")
    delayed_scales = torch.tensor([37.5, 0.25, 3.0])
    want_data, want_scale = _stacked_reference(x, recipe, fp8_dtype, delayed_scales)
    data, scale_inv, amax = _stacked_in_one_pass(x, recipe, fp8_dtype, delayed_scales, seed=9)
    assert torch.equal(data, want_data.view(torch.uint8).view(x.shape))
    assert torch.equal(_bytes(scale_inv), _bytes(want_scale))
    cells_per_expert = 1 if recipe != "blockwise" else (n // 128) * -(-k // 128)
    assert amax.numel() == experts * cells_per_expert
    expert_amax = amax.reshape(experts, -1).amax(1)
    assert expert_amax[0] < 0.1 < 100 < expert_amax[2]


def test_stacked_cell_rows():
    """Cells of N rows (per tensor) or the block's rows, when they tile N and the kernel tile
    (32 rows); None otherwise, and for mxfp8's 1x32 cells."""
    rows = {
        (recipe, n): pq.stacked_cell_rows(torch.Size([8, n, 64]), recipe_spec(recipe))
        for recipe in RECIPES
        for n in (48, 64, 256, 200)
    }
    assert [rows[("tensorwise", n)] for n in (48, 64, 256, 200)] == [None, 64, 256, None]
    assert [rows[("delayed", n)] for n in (48, 64, 256, 200)] == [None, 64, 256, None]
    assert [rows[("blockwise", n)] for n in (48, 64, 256, 200)] == [None, None, 128, None]
    assert [rows[("mxfp8", n)] for n in (48, 64, 256, 200)] == [None] * 4
    with pytest.raises(ValueError, match="cell rows must be a multiple of 32, got 48"):
        pq.piece_cell_amax_(
            torch.ones(96),
            torch.zeros(2),
            shape=torch.Size([2, 48, 1]),
            spec=recipe_spec("tensorwise"),
            columnwise=False,
            param_start=0,
            cell_rows=48,
        )


def test_partial_amaxes_of_a_straddled_block():
    """Two pieces cutting one 128x128 block mid-row each see only their own elements."""
    x = torch.zeros(128, 256)
    x[10, 5], x[100, 7], x[3, 200] = -9.0, 4.0, 2.5
    flat = x.reshape(-1)
    cut = 50 * 256 + 3  # mid-row 50, inside block (0, 0)
    first, second = (torch.zeros(2) for _ in range(2))
    pq.piece_cell_amax_(
        flat[:cut],
        first,
        shape=x.shape,
        spec=recipe_spec("blockwise"),
        columnwise=False,
        param_start=0,
    )
    pq.piece_cell_amax_(
        flat[cut:],
        second,
        shape=x.shape,
        spec=recipe_spec("blockwise"),
        columnwise=False,
        param_start=cut,
    )
    assert first.tolist() == [9.0, 2.5]
    assert second.tolist() == [4.0, 0.0]


def test_bad_pieces_are_refused():
    x = torch.ones(64, 64)
    with pytest.raises(ValueError, match="outside a weight of 4096 elements"):
        pq.piece_cell_amax_(
            x.reshape(-1)[:100],
            torch.zeros(1),
            shape=x.shape,
            spec=recipe_spec("tensorwise"),
            columnwise=False,
            param_start=4000,
        )
    with pytest.raises(ValueError, match="fp32 with 128 cells"):
        pq.piece_cast_(
            x.reshape(-1),
            torch.ones(5),
            torch.empty(4096, dtype=torch.uint8),
            shape=x.shape,
            spec=recipe_spec("mxfp8"),
            columnwise=True,
            param_start=0,
            fp8_dtype=E4M3,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_pieces_equal_torch_twin(recipe, fp8_dtype):
    from megatron.core.fp8.cuda import triton_available

    assert triton_available(), "the Triton kernels are the path under test here"
    shapes = (*SHAPES, (1024, 4096), (4096, 1000))
    for index, shape in enumerate(shapes):
        x = _weight(shape, seed=100 + index, device="cuda", edges=index % 2 == 0)
        # On the CPU, as a delayed scale is before its Fp8Linear's first forward moves it.
        delayed_scale = torch.tensor(0.75, dtype=torch.float32)
        for pieces in (1, 2, 5):
            cuts = _cuts(x.numel(), pieces=pieces, seed=7 * index + pieces)
            got = _quantize_in_pieces(
                x, recipe=recipe, fp8_dtype=fp8_dtype, cuts=cuts, delayed_scale=delayed_scale
            )
            want = _quantize_in_pieces(
                x.cpu(), recipe=recipe, fp8_dtype=fp8_dtype, cuts=cuts, delayed_scale=delayed_scale
            )
            for columnwise in got:
                for name, a, b in zip(
                    ("bytes", "scale_inv", "amax"), got[columnwise], want[columnwise]
                ):
                    assert torch.equal(_bytes(a.cpu()), _bytes(b)), (
                        recipe,
                        shape,
                        cuts,
                        columnwise,
                        name,
                    )


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(STACKED))
def test_triton_stacked_one_pass_equals_torch_twin(recipe):
    experts, n, k = STACKED[recipe]
    x = torch.randn(experts, n, k, generator=torch.Generator().manual_seed(4)) * 5
    scales = torch.tensor([37.5, 0.25, 3.0])
    got = _stacked_in_one_pass(x.cuda(), recipe, E4M3, scales, seed=2)
    want = _stacked_in_one_pass(x, recipe, E4M3, scales, seed=2)
    for name, a, b in zip(("bytes", "scale_inv", "amax"), got, want):
        assert torch.equal(_bytes(a.cpu()), _bytes(b)), (recipe, name)


@pytest.mark.gpu
def test_triton_whole_bands_equal_torch_twin():
    x = _weight((256, 4096), seed=5, device="cuda", edges=True)
    outputs = {}
    for device in ("cuda", "cpu"):
        values = x.to(device)
        views = dict(
            row_data=torch.empty(256, 4096, dtype=torch.uint8, device=device),
            row_scale=torch.empty(256, 128, dtype=torch.uint8, device=device),
            col_data=torch.empty(256, 4096, dtype=torch.uint8, device=device),
            col_scale=torch.empty(8, 4096, dtype=torch.uint8, device=device),
        )
        pq.quantize_mxfp8_rows_(values, fp8_dtype=E4M3, **views)
        outputs[device] = {key: value.cpu() for key, value in views.items()}
        # One direction alone (the columnwise copy a ZeRO-3 backward gather quantizes, the
        # rowwise one a write stores): the same bytes and scales as both at once.
        for direction in ("row", "col"):
            other = "col" if direction == "row" else "row"
            alone = {key: torch.full_like(view, 7) for key, view in views.items()}
            alone.update({f"{other}_data": None, f"{other}_scale": None})
            pq.quantize_mxfp8_rows_(values, fp8_dtype=E4M3, **alone)
            for key in (f"{direction}_data", f"{direction}_scale"):
                assert torch.equal(alone[key].cpu(), outputs[device][key]), (device, key)
    for key in outputs["cpu"]:
        assert torch.equal(outputs["cuda"][key], outputs["cpu"][key]), key
