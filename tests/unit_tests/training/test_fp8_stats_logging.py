"""--log-fp8-stats (issue 41): the fractions an Fp8Linear logs equal a plain-torch reference
computed here for every recipe and role (acceptance 3), the losses are bitwise those of a run
without the statistics, and the statistics reach the log and the metric names."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from megatron.core import fused_pass
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.linear import Fp8Linear
from megatron.training.flags.arguments import parse_args
from megatron.training.fp8_stats import Fp8StatsCollector, log_lines, scalars
from megatron.training.loggers import MetricsLogger
from tests.unit_tests.fp8.test_compile import _fp8_layer
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROWS, K, N = 16, 128, 128


def _spread(shape, *, low: int, high: int, seed: int) -> torch.Tensor:
    """Values over 2^low .. 2^high with random signs, and a few exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(low, high + 1, shape, generator=gen).to(torch.float32)
    t = torch.randn(shape, generator=gen) * torch.exp2(exponent)
    t[0, 1:4] = 0.0
    return t


def _operands() -> dict[str, torch.Tensor]:
    x = _spread((ROWS, K), low=-22, high=2, seed=1)
    w = _spread((N, K), low=-24, high=-1, seed=2)
    dy = _spread((ROWS, N), low=-32, high=0, seed=3)
    # Above the formats' maxima at delayed scaling's first scale (1.0): these saturate.
    x[2, 5], w[7, 9], dy[3, 4] = 1000.0, -600.0, 1.0e5
    return {"input": x, "weight": w, "grad": dy}


def _pow2_floor(v: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - 1)


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(mantissa == 0.5, exponent - 1, exponent))


def _cell_amax(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = t.shape
    amax = t.abs().reshape(m // rows, rows, k // cols, cols).amax(dim=(1, 3))
    return amax.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)


def _multiplier(t: torch.Tensor, recipe: str, role: str, fp8_max: float) -> torch.Tensor:
    """What the recipe multiplies t by before the cast (FP8_NUMERICS.md), from plain torch."""
    if recipe == "delayed":
        return torch.ones_like(t)  # the first step's scale: no amax recorded yet
    if recipe == "tensorwise":
        return torch.full_like(t, fp8_max) / t.abs().amax()
    if recipe == "blockwise":
        cells = (128, 128) if role == "weight" else (1, 128)
        return _pow2_floor(fp8_max / _cell_amax(t, *cells))
    amax = _cell_amax(t, 1, 32)  # mxfp8: E8M0 scale 2^ceil(log2(amax / max))
    return 1.0 / _pow2_ceil(amax * (1.0 / torch.tensor(fp8_max)))


def _reference(t: torch.Tensor, recipe: str, role: str) -> tuple[float, float]:
    """(saturated fraction of all, flushed fraction of the non-zeros), plain torch casts."""
    dtype = E5M2 if role == "grad" else E4M3
    fp8_max = torch.finfo(dtype).max
    scaled = t * _multiplier(t, recipe, role, fp8_max)
    # saturated: rounds past max in the format's precision (a quarter of it cast, times 4)
    quarter = (scaled.abs() / 4).clamp(max=fp8_max).to(dtype).to(torch.float32)
    saturated = (quarter * 4 > fp8_max).sum().item()
    cast = scaled.clamp(-fp8_max, fp8_max).to(dtype).to(torch.float32)
    nonzero = t != 0
    flushed = (nonzero & (cast == 0)).sum().item()
    return saturated / t.numel(), flushed / nonzero.sum().item()


def _collect(recipe: str, operands: dict[str, torch.Tensor], *, microbatches: int = 1):
    linear = Fp8Linear(K, N, bias=False, fp8_config=Fp8Config(recipe=recipe))
    with torch.no_grad():
        linear.weight.copy_(operands["weight"])
    collector = Fp8StatsCollector(
        nn.ModuleDict({"fc": linear}), interval=1, recipe=recipe, fp8_format="hybrid"
    )
    collector.switch(True)
    for _ in range(microbatches):
        x = operands["input"].clone().requires_grad_()
        linear(x).backward(operands["grad"])
    collector.switch(False)
    assert linear.fp8_stats_sink is None and not linear.fp8_stats_on
    return collector.read()


@pytest.mark.parametrize("recipe", RECIPES)
def test_logged_fractions_equal_plain_torch_reference(recipe: str):
    operands = _operands()
    stats = _collect(recipe, operands)
    assert sorted(stats) == [("fc", "grad"), ("fc", "input"), ("fc", "weight")]
    for role, t in operands.items():
        got = stats[("fc", role)]
        saturated, underflow = _reference(t, recipe, role)
        assert (got.saturated_fraction, got.underflow_fraction) == (saturated, underflow), role
        assert got.amax == t.abs().max().item() and got.numel == t.numel()
        assert got.nonzero == t.numel() - 3
        assert 0.0 < underflow < 1.0  # some values flush, not all
        if recipe == "delayed":
            assert saturated == 1 / t.numel() and got.scale == 1.0
        else:
            assert saturated == 0.0  # current scaling: the amax maps to at most the max
    if recipe == "tensorwise":
        assert stats[("fc", "input")].scale == pytest.approx(448.0 / 1000.0, rel=1e-7)


def test_micro_batches_add_up():
    operands = _operands()
    once, twice = _collect("tensorwise", operands), _collect("tensorwise", operands, microbatches=2)
    for key, item in once.items():
        assert twice[key].numel == 2 * item.numel and twice[key].nonzero == 2 * item.nonzero
        assert twice[key].underflow_fraction == item.underflow_fraction
        assert twice[key].amax == item.amax and twice[key].scale == item.scale


def test_log_lines_and_metric_names():
    stats = _collect("delayed", _operands())
    series = scalars(stats)
    assert len(series) == 12 and series["fp8-stats/fc/input/amax"] == 1000.0
    assert series["fp8-stats/fc/grad/saturated"] == 1 / (ROWS * N)
    logger = MetricsLogger(
        tensorboard_dir=None,
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        run_config={},
        enabled=True,
    )
    logger.log_scalars(5, series)  # the fp8-stats/ family is a known name
    with pytest.raises(ValueError, match="unknown metric"):
        logger.log_scalars(5, {"fp8-statistics/fc/input/amax": 1.0})
    lines = log_lines(5, stats)
    assert len(lines) == 3 and lines[0].startswith(" > fp8 stats iteration 5 | input (1 Linears)")
    assert "max amax: 1000 (fc)" in lines[0] and "saturated: 4.883e-04 fc" in lines[0]


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_losses_bitwise_equal_with_and_without_stats(recipe: str, capsys):
    argv = TINY_GPT + NO_DROPOUT + ["--train-iters", "4", "--fp8-recipe", recipe]
    plain = run_pretrain(argv)
    capsys.readouterr()
    watched = run_pretrain(argv + ["--log-fp8-stats", "--log-fp8-stats-interval", "2"])
    out = capsys.readouterr().out
    assert watched.losses == plain.losses and watched.grad_norms == plain.grad_norms
    for iteration in (2, 4):
        for role in ("input", "weight", "grad"):
            assert f" > fp8 stats iteration {iteration} | {role} (8 Linears)" in out
    assert "fp8 stats iteration 1 " not in out and "fp8 stats iteration 3 " not in out


def test_flag_needs_fp8_and_a_positive_interval(capsys):
    for extra, message in (
        (["--log-fp8-stats"], "--log-fp8-stats needs --fp8-recipe"),
        (["--fp8-recipe", "tensorwise", "--log-fp8-stats-interval", "0"], "must be positive"),
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(TINY_GPT + ["--train-iters", "1"] + extra, world_size=1)
        assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fp8_params", [False, True])
def test_compiled_layer_statistics_step_runs_eagerly_and_keeps_its_graph(fp8_params: bool):
    # As compile_layers and fp8_stats_step: the statistics step under set_stance("force_eager")
    # equals an eager layer bitwise; the compiled steps around it reuse the one graph.
    layer, eager_layer = (_fp8_layer("mxfp8", fp8_params=fp8_params, device="cpu") for _ in "12")
    prepare_for_compile(layer)
    layer.forward = torch.compile(layer.forward)
    collector = Fp8StatsCollector(layer, interval=1, recipe="mxfp8", fp8_format="hybrid")
    x0 = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def step(module: nn.Module, on: bool) -> tuple[torch.Tensor, dict]:
        collector.switch(on)
        with torch.compiler.set_stance("force_eager" if on else "default"):
            y = module(x0.clone().requires_grad_())
            y.float().sum().backward()
        collector.switch(False)
        return y.detach(), collector.read()

    torch._dynamo.reset()
    counters.clear()
    compiled, none = step(layer, False)
    watched, stats = step(layer, True)
    again, _ = step(layer, False)
    plain, _ = step(eager_layer, False)
    assert not none and len(stats) == (8 if fp8_params else 12)  # no weight role for FP8 params
    assert torch.equal(watched, plain) and torch.equal(again, compiled)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.slow
def test_fused_statistics_passes_in_a_compiled_layer_statistics_step(monkeypatch):
    # On CUDA each statistics pass is a torch.compile'd kernel, called from the layer that runs
    # under set_stance("force_eager"): here compiled on CPU, the statistics and the outputs
    # equal the eager passes' bitwise, and the layer's compiled graph stays free of breaks.
    layer = _fp8_layer("mxfp8", fp8_params=False, device="cpu")
    prepare_for_compile(layer)
    layer.forward = torch.compile(layer.forward)
    collector = Fp8StatsCollector(layer, interval=1, recipe="mxfp8", fp8_format="hybrid")
    x0 = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def step(on: bool) -> tuple[torch.Tensor, dict]:
        collector.switch(on)
        with torch.compiler.set_stance("force_eager" if on else "default"):
            y = layer(x0.clone().requires_grad_())
            y.float().sum().backward()
        collector.switch(False)
        return y.detach(), collector.read()

    torch._dynamo.reset()
    counters.clear()
    compiled, _ = step(False)
    eager_out, eager_stats = step(True)
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: True)
    fused_out, fused_stats = step(True)
    again, _ = step(False)
    assert torch.equal(fused_out, eager_out) and torch.equal(again, compiled)
    assert fused_stats == eager_stats and len(fused_stats) == 12
    assert counters["stats"]["unique_graphs"] > 1 and not counters["graph_break"]
