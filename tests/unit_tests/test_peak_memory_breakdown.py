"""dev/peak_memory_breakdown.py on a small hand-made trace: the live set at the peak, by site."""

from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "peak_memory_breakdown", REPO / "dev" / "peak_memory_breakdown.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frame(name: str, line: int) -> list[dict]:
    return [
        {
            "filename": "/usr/lib/python3/site-packages/torch/nn/functional.py",
            "line": 1,
            "name": "f",
        },
        {"filename": str(REPO / "megatron" / "x.py"), "line": line, "name": name},
    ]


def test_peak_live_set_grouped_by_innermost_repository_frame():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frame("weights", 10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frame("activations", 20)},
        {"action": "alloc", "addr": 3, "size": 70, "frames": _frame("activations", 20)},
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 2, "size": 10, "frames": _frame("grads", 30)},
        {"action": "free_completed", "addr": 3, "size": 70},  # a trace with completions only
        {"action": "alloc", "addr": 4, "size": 40, "frames": []},
    ]
    snapshot = {
        "device_traces": [trace],
        "segments": [
            {
                "device": 0,
                "blocks": [
                    {"address": 9, "size": 5, "state": "active_allocated"},  # before the trace
                    {"address": 1, "size": 100, "state": "active_allocated"},  # traced
                ],
            }
        ],
    }
    peak, by_site = _module().peak_breakdown(snapshot)
    assert peak == 5 + 100 + 50 + 70  # after the third alloc
    assert by_site == {
        "(before the trace)": 5,
        "megatron/x.py:10 weights": 100,
        "megatron/x.py:20 activations": 120,
    }


def test_blocks_freed_in_the_trace_but_allocated_before_it_count_from_the_start():
    # The ring buffer dropped block 7's allocation: its free shows it was live when the
    # window opened, so the peak (before the free) includes it.
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frame("weights", 10)},
        {"action": "free_requested", "addr": 7, "size": 30},
        {"action": "free_completed", "addr": 7, "size": 30},
        {"action": "alloc", "addr": 2, "size": 20, "frames": _frame("activations", 20)},
    ]
    snapshot = {"device_traces": [trace], "segments": []}
    peak, by_site = _module().peak_breakdown(snapshot)
    assert peak == 130
    assert by_site == {"(before the trace)": 30, "megatron/x.py:10 weights": 100}


def test_depth_names_a_site_by_its_callers_too():
    outer = {"filename": str(REPO / "megatron" / "y.py"), "line": 7, "name": "backward"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 30, "frames": _frame("gemm", 10) + [outer]},
        {"action": "alloc", "addr": 2, "size": 20, "frames": _frame("gemm", 10)},
    ]
    peak, by_site = _module().peak_breakdown({"device_traces": [trace]}, depth=2)
    assert peak == 50
    assert by_site == {
        "megatron/x.py:10 gemm <- megatron/y.py:7 backward": 30,
        "megatron/x.py:10 gemm": 20,
    }
