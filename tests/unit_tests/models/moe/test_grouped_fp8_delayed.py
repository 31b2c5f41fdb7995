"""Delayed scaling on the experts' grouped path (moe/grouped_fp8.py with
fp8_experts.DelayedExperts) against the per-segment path (one Fp8Linear call per expert and
segment), on CPU: over several steps inside fp8_autocast, the outputs, input and weight
gradients are bitwise equal, and so is every expert's delayed-scaling state (scale and amax
history of the input, weight and grad metas) after each step's flushes, under the rule both
paths follow (`fp8_experts.schedule_expert_flushes`): every expert's metas are flushed on
every call, an expert without rows recording amax 0 (its weight's amax: the weight's).
High-precision weights and FP8 parameters, ragged segments with an empty expert, several
segments per expert (expert parallelism), a recompute, and two gloo ranks routing to
different experts."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from megatron.core import fused_pass
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.autocast import fp8_autocast
from megatron.core.fp8.formats import ROLES, fp8_dtype_for_role
from megatron.core.fp8.quantization import quantize
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.transformer.moe import fp8_experts
from megatron.core.transformer.moe import grouped_operands as operands
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear

EXPERTS, IN, OUT = 4, 64, 48
SEGMENTS = [[40], [0], [56], [33]]  # expert 1 without rows
EP_SEGMENTS = [[40, 24], [0, 0], [0, 56], [30, 3]]  # two source ranks, empty segments
STEPS = 4


def _layer(dtype: torch.dtype) -> Fp8StackedLinear:
    config = Fp8Config(recipe="delayed", fp8_format="hybrid")
    layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=dtype, device="cpu")
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1.0, 3.0, 300.0, 0.004]).view(EXPERTS, 1, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(EXPERTS, OUT, IN, generator=generator) * magnitudes / 8)
    return layer


def _as_fp8_parameter(layer: Fp8StackedLinear) -> None:
    """The stacked FP8 parameter as the engine holds it under delayed scaling: each expert
    quantized at its weight meta's scale, bytes and scale_inv stacked."""
    fp8_dtype = fp8_dtype_for_role("hybrid", "weight")
    weight = layer.weight.detach()
    parts = [
        quantize(
            weight[e],
            recipe="delayed",
            fp8_dtype=fp8_dtype,
            role="weight",
            scale=layer.delayed_scaling.experts[e].metas["weight"].scale,
            backend="reference",
        )
        for e in range(EXPERTS)
    ]
    stacked = QuantizedTensor(
        shape=weight.shape,
        dtype=weight.dtype,
        recipe="delayed",
        fp8_dtype=fp8_dtype,
        role="weight",
        rowwise_data=torch.stack([p.rowwise_data for p in parts]),
        rowwise_scale_inv=torch.stack([p.rowwise_scale_inv for p in parts]),
    )
    layer.weight = torch.nn.Parameter(stacked)


def _step(layer, segments, step: int, dtype, device="cpu", recompute=False):
    rows = sum(sum(counts) for counts in segments)
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(rows, IN, generator=generator) * torch.linspace(0.01, 40, rows)[:, None]
    dy = torch.randn(rows, OUT, generator=generator) * (10.0**step)  # grads that move
    layer.weight.grad = None
    tokens = x.to(dtype).to(device).requires_grad_()
    counts = [sum(c) for c in segments]
    with fp8_autocast(layer):
        if recompute:  # the forward runs again in backward, at its first run's scales
            y = checkpoint(lambda t: layer(t, counts, segments), tokens, use_reentrant=False)
        else:
            y = layer(tokens, counts, segments)
    y.backward(dy.to(dtype).to(device))
    return y.detach(), tokens.grad, layer.weight.grad


def _step_on(layer, segments, step: int, device):
    return _step(layer, segments, step, torch.bfloat16, device)


def _state(layer):
    return [
        (meta.scale.clone(), meta.amax_history.clone())
        for scaling in layer.delayed_scaling.experts
        for meta in (scaling.metas[role] for role in ROLES)
    ]


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_param", [False, True])
def test_delayed_grouped_path_equals_the_per_segment_path_bitwise(
    segments, dtype, fp8_param, monkeypatch
):
    reference, grouped = _layer(dtype), _layer(dtype)
    if fp8_param:
        _as_fp8_parameter(reference)
        _as_fp8_parameter(grouped)
    reference.grouped, grouped.grouped = False, True
    calls = []
    real = fp8_experts.grouped_fp8_linear
    monkeypatch.setattr(
        fp8_experts, "grouped_fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    initial = _state(reference)
    for step in range(STEPS):
        want, got = _step(reference, segments, step, dtype), _step(grouped, segments, step, dtype)
        assert len(calls) == step + 1  # the grouped layer took the grouped path
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        after_want, after_got = _state(reference), _state(grouped)
        for (scale_a, history_a), (scale_b, history_b) in zip(after_got, after_want, strict=True):
            assert torch.equal(scale_a, scale_b) and torch.equal(history_a, history_b)
    roles = len(ROLES)
    for e in range(EXPERTS):
        moved = [
            not torch.equal(after_got[e * roles + i][1], initial[e * roles + i][1])
            for i in range(roles)
        ]
        has_rows = sum(segments[e]) > 0
        # Every expert's weight amax is recorded, rows or not (an expert without rows records
        # input and grad amax 0: those histories stay zeros); FP8 parameters: the engine
        # quantizes the weight, so the module records none.
        assert moved == [has_rows, not fp8_param, has_rows], (e, moved)
    assert after_got[2 * roles][0] != initial[2 * roles][0]  # expert 2's input scale moved


@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
def test_a_recomputed_forward_keeps_the_per_segment_path_s_scales_and_records(segments):
    """Activation recompute (non-reentrant checkpoint): the recomputed forward quantizes at its
    first run's scales and records nothing; the backward's grad amaxes are recorded."""
    reference, grouped = _layer(torch.bfloat16), _layer(torch.bfloat16)
    reference.grouped, grouped.grouped = False, True
    for step in range(STEPS):
        options = dict(dtype=torch.bfloat16, recompute=True)
        want = _step(reference, segments, step, **options)
        got = _step(grouped, segments, step, **options)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        for (scale_a, history_a), (scale_b, history_b) in zip(
            _state(grouped), _state(reference), strict=True
        ):
            assert torch.equal(scale_a, scale_b) and torch.equal(history_a, history_b)


def test_each_role_s_expert_metas_are_consecutive_rows_after_a_step():
    """After a step's flushes each role's expert metas are consecutive rows of one tensor, so
    the next call records each role's amaxes in one slice (`autocast.record_amaxes`), not
    one small write per expert."""
    from megatron.core.fp8 import autocast

    layer = _layer(torch.bfloat16)
    _step(layer, EP_SEGMENTS, 0, torch.bfloat16)
    for role in ROLES:
        histories = [s.metas[role].amax_history for s in layer.delayed_scaling.experts]
        base, rows = autocast._rows_of(histories, shape=histories[0].shape)
        assert base is not None and rows == list(range(rows[0], rows[0] + EXPERTS)), role


def test_delayed_experts_read_their_counts_on_the_host():
    """The grouped call needs the experts with rows on the host (their metas alone record):
    a delayed layer never takes device counts."""
    layer = _layer(torch.float32)
    assert not layer.takes_device_counts(torch.zeros(3, IN))
    tensorwise = Fp8StackedLinear(
        EXPERTS, IN, OUT, fp8_config=Fp8Config(recipe="tensorwise"), dtype=torch.float32
    )
    assert tensorwise.takes_device_counts(torch.zeros(3, IN))


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_eager_token_passes_compiled_give_the_eager_bytes(recipe, monkeypatch):
    """Called eagerly (delayed's experts always, any recipe without --torch-compile), the
    per-tensor token and weight passes run compiled on CUDA (`fused_pass.fused`); compiled
    here on CPU, over STEPS steps with EP segments, outputs, gradients and delayed state are
    bitwise those of the eager passes, with graphs compiled and no fallback."""
    use = [False]
    monkeypatch.setattr(fused_pass, "fused_on", lambda device: use[0])
    layers = []
    for _ in range(2):
        layer = _layer(torch.bfloat16)  # seeded weights
        if recipe != "delayed":
            seeded, config = layer.weight.data, Fp8Config(recipe=recipe)
            layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=torch.bfloat16)
            layer.weight.data.copy_(seeded)
        layer.grouped = True
        layers.append(layer)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs eagerly, compile failed")
        for step in range(STEPS):
            outs = []
            for fused in (False, True):
                use[0] = fused
                outs.append(_step(layers[fused], EP_SEGMENTS, step, torch.bfloat16))
            for a, b in zip(*outs, strict=True):
                assert a.isfinite().all() and torch.equal(a.view(torch.int16), b.view(torch.int16))
            if recipe == "delayed":
                for (scale_a, history_a), (scale_b, history_b) in zip(*map(_state, layers)):
                    assert torch.equal(scale_a, scale_b) and torch.equal(history_a, history_b)
    # compiled: the input and grad passes, the weights' quantization (and delayed's weight amax)
    assert counters["stats"]["unique_graphs"] >= (4 if recipe == "delayed" else 3)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["input", "grad"])
def test_cuda_compiled_segment_passes_give_the_eager_bytes_and_scales(role, monkeypatch):
    """The GPU twin of the test above at the pass itself: on CUDA the compiled per-tensor
    segment passes (Inductor's Triton kernels, whose fp32 `/` is approximate: the scales divide
    in fp64, `reference.scale_from_amax`) give the eager passes' bytes, scale_inv and amaxes bit
    for bit, for segments of amaxes over 60 binades (and an empty one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the CPU twin forces the compile above)")
    sizes = torch.tensor([300, 0, 1, 4096, 77, 1000], device="cuda")
    seg_ids = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"), sizes)
    generator = torch.Generator(device="cuda").manual_seed(1)
    exponents = torch.randint(-30, 30, (len(sizes),), device="cuda", generator=generator)
    magnitude = torch.exp2(exponents.float())
    x = (
        torch.randn(len(seg_ids), 256, device="cuda", generator=generator)
        * magnitude[seg_ids, None]
    )
    x = x.to(torch.bfloat16)
    fp8_dtype = fp8_dtype_for_role("hybrid", role)
    scale = torch.rand(len(sizes), device="cuda", generator=generator) * 100
    results = []
    for compiled in (False, True):
        monkeypatch.setattr(fused_pass, "fused_on", lambda device, on=compiled: on)
        current = operands.quantize_segments(
            x, seg_ids, len(sizes), fp8_dtype=fp8_dtype, power_2_scale=False
        )
        at, amax = operands.quantize_segments_at(x, seg_ids, scale, fp8_dtype=fp8_dtype)
        results.append([t.view(torch.uint8) for t in (*current, *at, amax)])
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


FAST_ACCUM_BOUND = 2e-3  # of the output's max|.|, as test_grouped_fp8.py's GPU twin


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [SEGMENTS, EP_SEGMENTS])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_cuda_delayed_grouped_path_equals_the_cpu_emulation(fp8_format, segments, monkeypatch):
    """The GPU twin: delayed's grouped call on CUDA (torch's FP8 grouped GEMM or the Triton
    kernels, at the experts' delayed scales) against the CPU emulation, over STEPS steps from
    the same state: outputs and gradients within the fast-accumulation bound (a bf16 output
    rounding apart), the same amax histories bitwise (amaxes of the same inputs and weights)
    and scales within fp32 rounding (the CUDA update is one fused kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the CPU emulation is the reference)")
    calls = []
    real = fp8_experts.grouped_fp8_linear
    monkeypatch.setattr(
        fp8_experts, "grouped_fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    layers = []
    for device in ("cuda", "cpu"):
        config = Fp8Config(recipe="delayed", fp8_format=fp8_format)
        layer = Fp8StackedLinear(
            EXPERTS, IN, OUT, fp8_config=config, dtype=torch.bfloat16, device=device
        )
        layer.weight.data.copy_(_layer(torch.bfloat16).weight.data)
        layers.append(layer)
    for step in range(STEPS):
        outs = []
        for layer in layers:
            got = _step_on(layer, segments, step, next(layer.parameters()).device)
            outs.append([t.float().cpu() for t in got])
        for a, b in zip(*outs, strict=True):
            bound = FAST_ACCUM_BOUND * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=2**-7, atol=bound)
        for (scale_a, history_a), (scale_b, history_b) in zip(_state(layers[0]), _state(layers[1])):
            assert torch.equal(history_a.cpu(), history_b)
            torch.testing.assert_close(scale_a.cpu(), scale_b, rtol=2**-22, atol=0)
    assert len(calls) == 2 * STEPS  # both layers took the grouped path at every step


def _two_ranks_with_different_idle_experts(rank: int, world_size: int, grouped: bool) -> list:
    """Each rank's experts' scales after STEPS steps under `apply_fp8_setup` over both ranks,
    each rank routing its tokens to other experts (rank 0 leaves expert 1 idle, rank 1 expert
    0 and 1), with different data."""
    import torch.distributed as dist

    from megatron.core.fp8.linear import apply_fp8_setup

    layer = _layer(torch.float32)
    layer.grouped = grouped
    apply_fp8_setup(layer, fp8_config=None, amax_reduction_group=dist.group.WORLD)
    segments = [[40], [0], [56], [33]] if rank == 0 else [[0], [0], [70], [9]]
    for step in range(STEPS):
        rows = sum(sum(counts) for counts in segments)
        generator = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(rows, IN, generator=generator) * (1 + 10 * rank)
        tokens = x.requires_grad_()
        y = layer(tokens, [sum(counts) for counts in segments], segments)
        y.backward(torch.randn(rows, OUT, generator=generator) * (1 + rank))
    return [meta.scale.item() for scaling in layer.delayed_scaling.experts
            for meta in (scaling.metas[role] for role in ROLES)]  # fmt: skip


@pytest.mark.parametrize("grouped", [True, False])
def test_ranks_routing_to_different_experts_agree_on_every_expert_s_scales(grouped):
    """Every local expert's metas join every flush, in expert order, on both paths: ranks
    whose tokens went to different experts pack the same metas into the MAX all-reduce (it
    paired one rank's expert 0 with another's expert 1, or sizes differed and gloo failed,
    when only the experts with rows were flushed), so each expert's scales agree."""
    from tests.unit_tests.dist_utils import run_distributed

    scales = run_distributed(_two_ranks_with_different_idle_experts, 2, grouped, timeout=300)
    assert scales[0] == scales[1]
    assert len(set(scales[0])) > 3  # the scales moved, differently per expert and role
