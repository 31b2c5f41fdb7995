"""CPU twin of benchmarks/bench_fp8.py's launch-config sweep: which config it keeps, that a kernel
taking over another's launches is off while that one is swept, and that the overrides are
restored when a candidate raises. Timings and outputs are faked; the GPU run is bench_fp8."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from megatron.core.fp8.cuda import quantize_common as qc

_PATH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "bench_fp8.py"


@pytest.fixture
def bench(tiles):
    spec = importlib.util.spec_from_file_location("bench_fp8_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeReporter:
    def __init__(self):
        self.rows = []

    def emit(self, row):
        self.rows.append(row)


def _fake_operands(monkeypatch, bench, *, seen, fail_on=None, bytes_of=None):
    """_operand_fn / kernel_ms fakes: a config's time is its "us" entry; its output bytes are
    bytes_of(config) (default: the same for every config)."""

    def operand_fn(x, key):
        config = dict(qc.tile_config(key))
        seen.append((key, config, dict(qc.tile_config("mxfp8_quads_dequantized"))))
        if fail_on is not None and config == fail_on:
            raise RuntimeError("candidate failed to compile")
        value = 7 if bytes_of is None else bytes_of(config)
        fn = lambda: torch.full((4,), value, dtype=torch.uint8)  # noqa: E731
        fn.us = config["us"]
        return fn, 1000

    monkeypatch.setattr(bench, "_operand_fn", operand_fn)
    monkeypatch.setattr(bench, "kernel_ms", lambda fn: fn.us / 1000)


def test_keeps_the_fastest_config_with_the_defaults_bytes(bench, monkeypatch):
    seen = []
    fast_but_wrong, slow, fast = dict(us=1), dict(us=5), dict(us=2)
    _fake_operands(
        monkeypatch, bench, seen=seen, bytes_of=lambda config: 9 if config == fast_but_wrong else 7
    )
    monkeypatch.setattr(bench, "SWEEP", {"block_1x128": [slow, fast_but_wrong, fast]})
    reporter = FakeReporter()
    bench.sweep_configs(reporter, torch.zeros(1), copy_gbps=1.0)
    assert qc.tile_config("block_1x128") == fast
    rows = [r for r in reporter.rows if r["bench"] == "sweep"]
    assert [r["same_bytes"] for r in rows] == [True, False, True]
    assert [r["gbps"] for r in rows] == [0.2, 1.0, 0.5]  # 1000 bytes / (us * 1e3) GB/s
    assert reporter.rows[-1]["bench"] == "tile_config"


def test_the_quads_kernel_is_off_while_the_kernel_it_replaces_is_swept(bench, tiles, monkeypatch):
    seen = []
    quads = dict(CHUNKS=1, num_warps=1, us=3)
    tiles("mxfp8_quads_dequantized", quads)
    _fake_operands(monkeypatch, bench, seen=seen)
    monkeypatch.setattr(bench, "SWEEP", {"mxfp8_dequantized": [dict(us=4), dict(us=2)]})
    bench.sweep_configs(FakeReporter(), torch.zeros(1), copy_gbps=1.0)
    assert [entry[2] for entry in seen] == [{}, {}]  # off during the sweep
    assert qc.tile_config("mxfp8_quads_dequantized") == quads  # and back afterwards
    assert qc.tile_config("mxfp8_dequantized") == dict(us=2)


def test_a_failing_candidate_restores_the_default_and_the_other_kernel(bench, tiles, monkeypatch):
    seen = []
    quads = dict(CHUNKS=1, num_warps=1, us=3)
    tiles("mxfp8_quads_dequantized", quads)
    default, broken = dict(us=4), dict(us=1)
    _fake_operands(monkeypatch, bench, seen=seen, fail_on=broken)
    monkeypatch.setattr(bench, "SWEEP", {"mxfp8_dequantized": [default, broken]})
    with pytest.raises(RuntimeError, match="failed to compile"):
        bench.sweep_configs(FakeReporter(), torch.zeros(1), copy_gbps=1.0)
    assert qc.tile_config("mxfp8_dequantized") == default
    assert qc.tile_config("mxfp8_quads_dequantized") == quads


def test_shipped_defaults_are_the_first_sweep_candidates(bench):
    """TILE_CONFIG holds what the sweep starts from (the measured default)."""
    for key, candidates in bench.SWEEP.items():
        assert candidates[0] == qc.TILE_CONFIG[key] == qc.tile_config(key), key


def test_linear_speedup_is_the_median_of_per_round_ratios(bench):
    # Per-round ratios 1.25, 1.6, 1.1 -> median 1.25; the ratio of the medians (bf16 1.1 over
    # FP8 0.8) would claim 1.375 from times measured in different rounds.
    ratios, speedup = bench.round_speedups([1.0, 1.2, 1.1], [0.8, 0.75, 1.0])
    assert [round(r, 6) for r in ratios] == [1.25, 1.6, 1.1]
    assert speedup == pytest.approx(1.25)
    with pytest.raises(ValueError):
        bench.round_speedups([1.0, 2.0], [1.0])


class _Timeline:
    """Fake CUDA clock for steady_ms: every step() costs `gpu_ms` of GPU time and is
    recorded, events record the step count when issued, and elapsed_time converts the
    steps issued between two events into milliseconds."""

    def __init__(self, gpu_ms):
        self.gpu_ms, self.steps, self.log = gpu_ms, 0, []

    def step(self):
        self.steps += 1
        self.log.append("step")

    def event(self, enable_timing=False):
        timeline = self

        class Event:
            def record(self):
                self.at = timeline.steps
                timeline.log.append("record")

            def synchronize(self):
                timeline.log.append("sync")

            def elapsed_time(self, end):
                return (end.at - self.at) * timeline.gpu_ms

        return Event()


def test_steady_timing_starts_behind_untimed_steps_and_times_only_the_batch(bench, monkeypatch):
    timeline = _Timeline(gpu_ms=0.75)
    monkeypatch.setattr(bench.torch.cuda, "Event", timeline.event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: timeline.log.append("sync"))
    host = []
    ms = bench.steady_ms(timeline.step, steps=4, repeats=2, lead=3, host=host)
    assert ms == pytest.approx(0.75)  # the lead steps are not in the timed window
    batch = ["step"] * 3 + ["record"] + ["step"] * 4 + ["record", "sync"]
    # 3 warm-up steps and a sync, then per repeat: 3 untimed steps, start, 4 timed, end.
    assert timeline.log == ["step"] * 3 + ["sync"] + batch * 2
    assert timeline.steps == 3 + 2 * (3 + 4)
    assert len(host) == 1  # one median over the repeats
