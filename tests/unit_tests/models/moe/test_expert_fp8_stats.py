"""--log-fp8-stats on the routed experts (issue 41): the fractions an Fp8StackedLinear logs
equal a plain-torch reference computed here, per recipe and role, with each segment and each
expert quantized as the recipe quantizes it alone; and a tiny MoE GPT logs its experts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.stats import fp8_stats_vector
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from megatron.training import fp8_stats
from megatron.training.fp8_stats import Fp8StatsCollector
from tests.unit_tests.training.common import run_pretrain
from tests.unit_tests.training.test_fp8_stats_logging import _cell_amax, _pow2_ceil, _pow2_floor
from tests.unit_tests.training.test_moe_training import TINY_MOE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXPERTS, IN, OUT = 4, 128, 96  # OUT: blockwise weights pad each expert to a 128-row cell
SEGMENTS = [[5, 3], [0, 0], [7, 1], [4, 2]]  # expert 1 without tokens; two source ranks each
SIZES = [n for counts in SEGMENTS for n in counts]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""CUDA: the grouped path's kernels (torch's FP8 grouped GEMM, the Triton ones) beside the
statistics, the reference's casts on the GPU too."""


def _spread(shape, *, low: int, high: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(low, high + 1, shape, generator=gen).to(torch.float32)
    return torch.randn(shape, generator=gen) * torch.exp2(exponent)


def _operands() -> dict[str, torch.Tensor]:
    rows = sum(SIZES)
    x = _spread((rows, IN), low=-20, high=0, seed=1)
    x[:5] *= 2.0**-6  # segments of very different magnitudes: one shared scale would differ
    x[2, 5], x[8, 0] = 1000.0, 0.0  # saturates at delayed scaling's first scale (1.0)
    w = _spread((EXPERTS, OUT, IN), low=-24, high=-1, seed=2)
    w[2] *= 64.0
    w[0, 7, 9] = -600.0
    dy = _spread((rows, OUT), low=-30, high=0, seed=3)
    dy[9, 4] = 1.0e5
    return {"input": x, "weight": w, "grad": dy}


def _multiplier(t: torch.Tensor, recipe: str, role: str, fp8_max: float, pow2=False):
    """What the recipe multiplies t (one segment, or one expert's weight) by before the cast."""
    if recipe == "delayed":
        return torch.ones_like(t)
    if recipe == "tensorwise":
        scale = torch.full_like(t, fp8_max) / t.abs().amax()
        return _pow2_floor(scale) if pow2 else scale
    if recipe == "mxfp8":
        amax = _cell_amax(t, 1, 32)
        return 1.0 / _pow2_ceil(amax * (1.0 / torch.tensor(fp8_max)))
    rows, cols = (128, 128) if role == "weight" else (1, 128)
    padded = torch.nn.functional.pad(t, (0, -t.shape[1] % cols, 0, -t.shape[0] % rows))
    cells = _pow2_floor(fp8_max / _cell_amax(padded, rows, cols))
    return cells[: t.shape[0], : t.shape[1]]


def _counts(pieces: list[torch.Tensor], recipe: str, role: str, pow2=False) -> tuple:
    """(saturated, flushed, non-zero, elements) of pieces, each quantized alone."""
    dtype = E5M2 if role == "grad" else E4M3
    fp8_max = torch.finfo(dtype).max
    saturated = flushed = nonzero = numel = 0
    for t in pieces:
        scaled = t * _multiplier(t, recipe, role, fp8_max, pow2)
        # saturated: rounds past max in the format's precision (a quarter of it cast, times 4)
        quarter = (scaled.abs() / 4).clamp(max=fp8_max).to(dtype).to(torch.float32)
        saturated += (quarter * 4 > fp8_max).sum().item()
        cast = scaled.clamp(-fp8_max, fp8_max).to(dtype).to(torch.float32)
        flushed += ((t != 0) & (cast == 0)).sum().item()
        nonzero, numel = nonzero + (t != 0).sum().item(), numel + t.numel()
    return saturated, flushed, nonzero, numel


def _collect(recipe: str, operands: dict[str, torch.Tensor], *, grouped: bool = True):
    device = operands["input"].device
    layer = Fp8StackedLinear(
        EXPERTS, IN, OUT, fp8_config=Fp8Config(recipe=recipe), dtype=torch.float32, device=device
    )
    layer.grouped = grouped
    with torch.no_grad():
        layer.weight.copy_(operands["weight"])
    collector = Fp8StatsCollector(
        nn.ModuleDict({"experts": layer}), interval=1, recipe=recipe, fp8_format="hybrid"
    )
    collector.switch(True)
    tokens = operands["input"].clone().requires_grad_()
    layer(tokens, [sum(counts) for counts in SEGMENTS], SEGMENTS).backward(operands["grad"])
    collector.switch(False)
    assert layer.fp8_stats_sink is None and not layer.fp8_stats_on
    return collector.read()


def _reference_pieces(operands, *, per_segment_path: bool) -> dict[str, list[torch.Tensor]]:
    """Each role's pieces as quantized: tokens and grads per segment; weights per expert
    (the per-segment path: once per non-empty segment of the expert)."""
    pieces = {
        role: [p for p in operands[role].split(SIZES) if len(p)] for role in ("input", "grad")
    }
    experts = (
        [e for e, counts in enumerate(SEGMENTS) for n in counts if n]
        if per_segment_path
        else range(EXPERTS)
    )
    pieces["weight"] = [operands["weight"][e] for e in experts]
    return pieces


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed", "mxfp8"])
def test_expert_fractions_equal_plain_torch_reference(recipe: str, device: str):
    operands = {role: t.to(device) for role, t in _operands().items()}
    stats = _collect(recipe, operands)
    assert sorted(stats) == [("experts", "grad"), ("experts", "input"), ("experts", "weight")]
    loop = recipe == "delayed"  # its grouped call counts as the per-segment path does
    pieces = _reference_pieces(operands, per_segment_path=loop)
    for role, parts in pieces.items():
        got = stats[("experts", role)]
        saturated, flushed, nonzero, numel = _counts(parts, recipe, role)
        assert (got.numel, got.nonzero) == (numel, nonzero), role
        assert got.saturated_fraction == saturated / numel, role
        assert got.underflow_fraction == flushed / nonzero, role
        assert got.amax == max(p.abs().max().item() for p in parts), role
        assert 0 < flushed < nonzero, role  # some values flush, not all
        # Current scaling maps each amax to the max (an fp32 rounding may cross it by an ulp).
        assert saturated > 0 if recipe == "delayed" else saturated <= len(parts), role
    if recipe == "tensorwise":
        # One scale per non-empty segment (6), their median and extremes; per expert for weights.
        tokens = stats[("experts", "input")]
        scales = [448.0 / p.abs().max().item() for p in pieces["input"]]
        assert tokens.num_scales == 6 and stats[("experts", "weight")].num_scales == EXPERTS
        assert tokens.scale_min == pytest.approx(min(scales), rel=1e-6)
        assert tokens.scale_max == pytest.approx(max(scales), rel=1e-6)
        assert tokens.scale == pytest.approx(sorted(scales)[2], rel=1e-6)  # lower median
    if recipe == "blockwise":
        assert stats[("experts", "weight")].num_scales == EXPERTS  # one padded cell each


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_grouped_and_per_segment_paths_log_the_same_tokens_and_grads(recipe: str):
    operands = _operands()
    grouped, loop = _collect(recipe, operands), _collect(recipe, operands, grouped=False)
    for role in ("input", "grad"):
        a, b = grouped[("experts", role)], loop[("experts", role)]
        assert (a.saturated_fraction, a.underflow_fraction, a.amax) == (
            b.saturated_fraction,
            b.underflow_fraction,
            b.amax,
        )


def test_segments_keep_a_device_free_summary_and_refuse_tall_cells():
    x = _operands()["input"]
    sizes = torch.tensor(SIZES)
    per_segment = fp8_stats_vector(x, recipe="tensorwise", role="input", segments=sizes)
    whole = fp8_stats_vector(x, recipe="tensorwise", role="input")
    assert per_segment[4] == 6 and whole[4] == 1  # num_scales: the non-empty segments
    assert per_segment[6] < whole[6]  # own scales flush fewer of the small segment's values
    blockwise = fp8_stats_vector(x, recipe="blockwise", role="input", segments=sizes)
    assert torch.equal(blockwise, fp8_stats_vector(x, recipe="blockwise", role="input"))
    with pytest.raises(ValueError, match="segments take no amax= and no 128-row cells"):
        fp8_stats_vector(x, recipe="blockwise", role="weight", segments=sizes)
    with pytest.raises(ValueError, match="segments take no amax="):
        fp8_stats_vector(x, recipe="tensorwise", role="input", segments=sizes, amax=x.max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_bf16_tokens_and_counts_on_the_device(recipe: str, device: str):
    # The dispatcher's form: bf16 tokens and weights, rows per expert as a tensor (one segment
    # each, read without a host sync), power-of-two scales for tensorwise too.
    counts = [8, 0, 8, 6]
    x = _spread((sum(counts), IN), low=-20, high=0, seed=5)
    x[:8] *= 2.0**-10
    x = x.bfloat16().to(device)
    w = _spread((EXPERTS, OUT, IN), low=-24, high=-1, seed=6).bfloat16().to(device)
    dy = _spread((sum(counts), OUT), low=-30, high=0, seed=7).bfloat16().to(device)
    config = Fp8Config(recipe=recipe, power_2_scale=True)
    layer = Fp8StackedLinear(
        EXPERTS, IN, OUT, fp8_config=config, dtype=torch.bfloat16, device=device
    )
    with torch.no_grad():
        layer.weight.copy_(w)
    collector = Fp8StatsCollector(
        nn.ModuleDict({"experts": layer}), interval=1, recipe=recipe, fp8_format="hybrid"
    )
    collector.switch(True)
    layer(x.clone().requires_grad_(), torch.tensor(counts, device=device)).backward(dy)
    collector.switch(False)
    stats = collector.read()
    pieces = {"input": x.float().split(counts), "grad": dy.float().split(counts)}
    pieces = {role: [p for p in parts if len(p)] for role, parts in pieces.items()}
    pieces["weight"] = list(w.float())
    for role, parts in pieces.items():
        got = stats[("experts", role)]
        if recipe == "tensorwise":  # powers of two: floor(fp8_max / amax) per segment
            dtype = E5M2 if role == "grad" else E4M3
            fp8_max = torch.finfo(dtype).max
            scales = [_pow2_floor(torch.tensor(fp8_max) / p.abs().max()).item() for p in parts]
            assert (got.scale_min, got.scale_max) == (min(scales), max(scales)), role
            assert got.num_scales == len(parts), role
        saturated, flushed, nonzero, numel = _counts(parts, recipe, role, pow2=True)
        assert (got.numel, got.nonzero, got.saturated_fraction) == (numel, nonzero, 0.0), role
        assert got.underflow_fraction == flushed / nonzero and flushed > 0, role


@pytest.mark.slow
def test_compiled_moe_gpt_logs_its_experts_and_keeps_its_graphs(capsys, monkeypatch):
    # A statistics step runs the compiled layers eagerly (set_stance("force_eager")); the
    # experts' switch adds no graph break or graph. The eager step's loss is the compiled
    # one's up to fp32 rounding (measured 7.6e-8 relative on CPU at step 2), the steps before
    # it bitwise.
    logged = []  # the (Linear, role) keys the log's lines are made from
    real_log_lines = fp8_stats.log_lines
    monkeypatch.setattr(
        fp8_stats, "log_lines", lambda it, stats: logged.extend(stats) or real_log_lines(it, stats)
    )
    argv = TINY_MOE + ["--train-iters", "2", "--fp8-recipe", "tensorwise", "--moe-grouped-gemm"]
    argv += ["--torch-compile"]
    seen = {}
    for name, extra in (
        ("plain", []),
        ("stats", ["--log-fp8-stats", "--log-fp8-stats-interval", "2"]),
    ):
        torch._dynamo.reset()
        counters.clear()
        losses = run_pretrain(argv + extra).losses
        seen[name] = (dict(counters["graph_break"]), counters["stats"]["unique_graphs"], losses)
    torch._dynamo.reset()
    assert seen["plain"][:2] == seen["stats"][:2] == ({}, 3)
    plain, stats = seen["plain"][2], seen["stats"][2]
    assert sorted(plain) == sorted(stats) == [1, 2] and plain[1] == stats[1]
    assert stats[2] == pytest.approx(plain[2], rel=1e-6)
    out = capsys.readouterr().out
    # 2 layers' qkv and proj, the dense MLP's fc1 and fc2, the shared expert's, and the
    # routed experts' fc1 and fc2 (one entry each, all experts together).
    for role in ("input", "weight", "grad"):
        assert f" > fp8 stats iteration 2 | {role} (10 Linears)" in out
    experts = {key for key in logged if ".mlp.experts." in key[0]}
    assert len(logged) == 30 and len(experts) == 2 * 3  # layer 1: fc1 and fc2 x 3 roles
    assert ("decoder.layers.1.mlp.experts.linear_fc1", "grad") in experts
