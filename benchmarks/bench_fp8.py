"""FP8 fast-path benchmark: quantization bandwidth and Linear fwd+bwd speed vs bf16 (one GPU).

    python benchmarks/bench_fp8.py --check          # bitwise self-check first; exit 1 on mismatch
    python benchmarks/bench_fp8.py --check --sweep  # also time alternative kernel launch configs
    python benchmarks/bench_fp8.py --no-quantize --shapes 4096x4096 --recipes tensorwise,delayed
                                                 # one Linear comparison only (~30 s)

(a) Quantization on an 8192x8192 bf16 tensor: bytes moved / time against the device-to-device
    copy bandwidth measured in the same run (target >= 60%): the public quantize_cuda API
    cases and the fused operand kernels Fp8Linear runs (linear_ops.quantize_operands).
(b) Linear forward+backward at M=8192 for (K, N) in (4096, 4096), (4096, 14336), (14336, 4096):
    megatron.core.fp8.Fp8Linear vs bf16 nn.Linear (targets: tensorwise/delayed 1.4x, blockwise
    1.3x, mxfp8 emulated 0.8x); --chain adds the quantize_cuda + scaled_mm API chain. Steps are
    timed as a training loop runs them: 20 issued back to back behind 3 untimed ones (so the
    GPU's queue is not empty when timing starts), CUDA events around the batch
    (time_ms), in 5 rounds that time every side once each; the speedup the targets apply to
    is the median of the rounds' ratios. Each row also gives host_ms, the host time to issue
    one step (above time_ms: launch-bound), and graph_ms, the step captured in a CUDA graph
    and replayed: its GPU time alone, for both sides.
One JSON line per case on stdout (and in $OUT/bench_fp8.jsonl when OUT is set), then a table.
Quantization times are device times (calls captured in a CUDA graph and replayed, so host
launch cost is not counted; the copy is timed the same way); Linear times as described in (b).
Medians over CUDA-event-timed iterations after warm-up. Budget: under 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.fp8.cuda import (  # noqa: E402
    blockwise_gemm_path,
    linear_ops,
    quantize_cuda,
    scaled_mm,
    triton_available,
)
from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda import quantize_mxfp8 as qmx
from megatron.core.fp8.cuda import quantize_per_tensor as qpt
from megatron.core.fp8.cuda.launch import direct_launch_status  # noqa: E402
from megatron.core.fp8.debug import DEBUG, set_debug_config  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
LINEAR_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
TOKENS = 8192
QUANT_SIZE = 8192
BANDWIDTH_TARGET = 0.60
SPEEDUP_TARGET = {"tensorwise": 1.4, "delayed": 1.4, "blockwise": 1.3, "mxfp8": 0.8}
# Stop starting new cases past this many seconds so the whole run stays under 4 minutes.
TIME_BUDGET_S = 200.0
# Interleaved timing rounds per Linear shape (bench_linear).
ROUNDS = 5


def cuda_time_ms(
    fn, *, warmup: int = 3, iters: int = 10, host: list | None = None, prime=None
) -> float:
    """Median milliseconds of fn() timed with CUDA events, after warm-up (compiles, caches).
    `host`, when given, receives the median host milliseconds spent issuing fn(). `prime`,
    when given, is called untimed before each timed fn(), after the last sync."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, host_times = [], []
    for _ in range(iters):
        if prime is not None:
            prime()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issued = time.perf_counter()
        fn()
        host_times.append((time.perf_counter() - issued) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    if host is not None:
        host.append(statistics.median(host_times))
    return statistics.median(times)


def _captured(fn, *, calls: int, warmups: int):
    """A CUDA graph of `calls` fn() calls (after `warmups` on a side stream, as capture
    needs), or None where fn cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph


def kernel_ms(fn, *, calls: int = 10) -> float:
    """Device milliseconds of one fn() call: `calls` calls captured in one CUDA graph, replayed
    and timed with CUDA events (median of 20 replays), so the host's launch cost, which on the
    lent machine exceeds a small kernel's run time, is not counted. Falls back to
    cuda_time_ms where fn cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = _captured(fn, calls=calls, warmups=1)
    if graph is None:
        return cuda_time_ms(fn, warmup=3, iters=20)
    return cuda_time_ms(graph.replay, warmup=2, iters=20) / calls


def steady_ms(
    step, *, steps: int = 20, repeats: int = 3, lead: int = 3, host: list | None = None
) -> float:
    """Milliseconds per step of `steps` steps issued back to back (no sync between them, as
    a training loop runs: the host issues step i+1 while the GPU runs step i), timed with CUDA
    events around the batch; median of `repeats` batches. Each batch starts behind `lead`
    untimed steps issued after the last sync, so the GPU already has work queued when the
    start event is reached, as inside a training step; without them the batch also timed the
    empty queue after the sync (the GPU waiting on the host's first launches: 0.2-0.6 ms per
    batch on an H200, most for the FP8 steps). A step whose host issue time exceeds its
    GPU time is still launch-bound here, as it would be in training. `host` receives the
    median host milliseconds spent issuing one timed step."""
    for _ in range(3):
        step()

    def run(count):
        for _ in range(count):
            step()

    batch_host: list[float] = []
    ms = cuda_time_ms(
        lambda: run(steps), warmup=0, iters=repeats, host=batch_host, prime=lambda: run(lead)
    )
    if host is not None:
        host.append(batch_host[0] / steps)
    return ms / steps


def graph_ms(step) -> float | None:
    """GPU milliseconds of one step captured in a CUDA graph and replayed (no host cost at
    all): what the step costs when the host keeps up. None when the step cannot be captured."""
    graph = _captured(step, calls=1, warmups=3)
    return None if graph is None else cuda_time_ms(graph.replay, warmup=3, iters=20)


class Reporter:
    """Collects result rows, prints each as one JSON line and mirrors them to $OUT."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        out_dir = os.environ.get("OUT")
        self.path = Path(out_dir) / "bench_fp8.jsonl" if out_dir else None
        if self.path is not None:
            self.path.write_text("")

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        line = json.dumps(row, sort_keys=True)
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(line + "\n")


def run_check(reporter: Reporter) -> bool:
    from tests.unit_tests.fp8.selfcheck import run_selfcheck

    started = time.perf_counter()
    cases, failures = run_selfcheck("cuda", quick=True)
    for message in failures[:20]:
        print("MISMATCH", message, flush=True)
    reporter.emit(
        {
            "bench": "check",
            "cases": cases,
            "mismatches": len(failures),
            "seconds": round(time.perf_counter() - started, 1),
            "pass": not failures,
        }
    )
    return not failures


def copy_bandwidth_gbps(x: torch.Tensor) -> float:
    dst = torch.empty_like(x)
    ms = kernel_ms(lambda: dst.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6


def _quant_cases(n: int) -> list[tuple[str, dict, int]]:
    """(name, quantize_cuda kwargs, bytes moved) for an n x n bf16 input.

    Bytes are what the kernels read and write: tensorwise reads the input twice (amax pass,
    then cast), every FP8 copy writes n*n bytes, scales 4 bytes per block (E8M0: 1 byte)."""
    elems, read = n * n, 2 * n * n
    blocks_1x128, blocks_1x32 = elems // 128, elems // 32
    return [
        (
            "tensorwise/rowwise",
            dict(recipe="tensorwise", role="input", rowwise=True, columnwise=False),
            2 * read + elems,
        ),
        (
            "tensorwise/rowwise+transpose",
            dict(
                recipe="tensorwise",
                role="input",
                rowwise=True,
                columnwise=True,
                with_transpose=True,
            ),
            2 * read + 2 * elems,
        ),
        (
            "delayed/rowwise+transpose",
            dict(
                recipe="delayed", role="input", rowwise=True, columnwise=True, with_transpose=True
            ),
            read + 2 * elems,
        ),
        (
            "blockwise/1x128 rowwise+columnwise",
            dict(recipe="blockwise", role="input", rowwise=True, columnwise=True),
            read + 2 * elems + 8 * blocks_1x128,
        ),
        (
            "blockwise/128x128 weight+transpose",
            dict(
                recipe="blockwise",
                role="weight",
                rowwise=True,
                columnwise=True,
                with_transpose=True,
            ),
            read + 2 * elems + 4 * (elems // 128**2),
        ),
        (
            "mxfp8/rowwise+columnwise",
            dict(recipe="mxfp8", role="input", rowwise=True, columnwise=True),
            read + 2 * elems + 2 * blocks_1x32,
        ),
    ]


def _operand_fn(x: torch.Tensor, key: str):
    """A callable running the fused kernel that TILE_CONFIG[key] configures, as Fp8Linear
    does (linear_ops.quantize_operands), plus the bytes it moves for an n x n bf16 x."""
    elems = x.numel()
    read = 2 * elems
    scales_1x128 = 4 * (elems // 128)
    scale = torch.tensor(64.0, device=x.device)
    history = torch.zeros(16, device=x.device)
    if key == "amax":
        bits = torch.zeros((), dtype=torch.int32, device=x.device)
        return (lambda: (qpt.launch_amax(x, bits), bits)[1]), read
    if key == "mxfp8_dequant":
        q = quantize_cuda(
            x,
            recipe="mxfp8",
            fp8_dtype=E4M3,
            role="weight",
            rowwise=True,
            columnwise=False,
            power_2_scale=True,
        )
        data, e8m0 = q["rowwise_data"], q["rowwise_scale_inv"]
        return (
            lambda: qmx.mxfp8_dequantize(
                data, e8m0, fp8_dtype=E4M3, columnwise=False, out_dtype=torch.bfloat16
            )
        ), elems + elems // 32 + 2 * elems
    if key == "block_1x128_fused":  # now only the API's columnwise copy in x's shape
        return (
            lambda: quantize_cuda(
                x,
                recipe="blockwise",
                fp8_dtype=E4M3,
                role="input",
                rowwise=True,
                columnwise=True,
                power_2_scale=True,
            )
        ), read + 2 * elems + 2 * scales_1x128
    if key in ("mxfp8", "mxfp8_quads"):  # bytes (quantize_cuda, FP8 weights), not Fp8Linear
        # "mxfp8" configures mxfp8_kernel, which now runs only with the transposed copy.
        transpose = key == "mxfp8"
        return (
            lambda: quantize_cuda(
                x,
                recipe="mxfp8",
                fp8_dtype=E4M3,
                role="input",
                rowwise=True,
                columnwise=True,
                power_2_scale=True,
                with_transpose=transpose,
            )
        ), read + (3 if transpose else 2) * elems + 2 * (elems // 32)
    # (recipe, role, rowwise, transposed, bytes); block_1x128 / block_128x1: one copy (one
    # kernel each), block_1x128_pair: both (one launch; empty: the fused kernel, or with its
    # config empty too, the two kernels).
    recipe, role, rowwise, transposed, moved = {
        "tensorwise": ("tensorwise", "input", True, True, 2 * read + 2 * elems),
        "cast": ("delayed", "input", True, False, read + elems),
        "cast_t": ("delayed", "input", True, True, read + 2 * elems),
        "block_1x128": ("blockwise", "input", True, False, read + elems + scales_1x128),
        "block_128x1": ("blockwise", "input", False, True, read + elems + scales_1x128),
        "block_1x128_pair": ("blockwise", "input", True, True, read + 2 * elems + 2 * scales_1x128),
        "block_128x128": ("blockwise", "weight", True, True, read + 2 * elems),
        # Both copies as bf16 values in one pass: a grad's quantization (or an input's read at
        # once); an input saved for backward keeps its columnwise copy as bytes instead.
        "mxfp8_dequantized": ("mxfp8", "grad", True, True, read + 4 * elems),
        "mxfp8_quads_dequantized": ("mxfp8", "grad", True, True, read + 4 * elems),
    }[key]

    def run():
        return linear_ops.quantize_operands(
            x,
            recipe=recipe,
            fp8_dtype=E4M3,
            role=role,
            rowwise=rowwise,
            transposed=transposed,
            power_2_scale=recipe in ("blockwise", "mxfp8"),
            scale=scale if recipe == "delayed" else None,
            amax_history=history if recipe == "delayed" else None,
        )

    return run, moved


# Launch configurations tried by --sweep (first entry of each: the shipped default).
def _cast(bm, bk, group, trans_x, warps):
    return dict(BM=bm, BK=bk, GROUP=group, TRANS_X=bool(trans_x), num_warps=warps)


SWEEP = {
    "amax": [
        dict(BLOCK=b, GROUP=g, num_warps=w)
        for b, g, w in ((16384, 1, 16), (8192, 8, 8), (8192, 16, 8), (4096, 8, 4))
    ],
    "cast": [_cast(*c) for c in ((64, 64, 4, 0, 4), (32, 128, 8, 0, 4), (64, 128, 4, 0, 4))],
    "cast_t": [
        _cast(*c)
        for c in (
            (64, 64, 4, 0, 4),
            (32, 128, 8, 1, 4),
            (64, 64, 8, 0, 4),
            (64, 32, 8, 0, 2),
            (32, 128, 4, 1, 4),
            (64, 128, 4, 0, 4),
            (64, 64, 8, 0, 8),
        )
    ],
    "block_1x128": [
        dict(BM=m, GROUP=g, num_warps=w)
        for m, g, w in ((64, 1, 4), (64, 2, 4), (32, 4, 4), (128, 1, 8), (16, 8, 4))
    ],
    "block_128x1": [
        dict(BK=k, TRANS_X=bool(t), num_warps=w)
        for k, t, w in ((64, 0, 4), (32, 1, 4), (64, 0, 8), (32, 1, 8), (16, 1, 4))
    ],
    "block_1x128_pair": [
        dict(BM=m, BK=k, TRANS_X=bool(t), num_warps=w)
        for m, k, t, w in ((64, 64, 0, 4), (128, 64, 0, 4), (32, 64, 0, 4))
    ]
    + [{}],
    "block_1x128_fused": [dict(num_warps=4), dict(num_warps=8), {}],
    "block_128x128": [
        dict(TRANS_X=t, num_warps=w)
        for t, w in ((True, 4), (True, 16), (False, 4), (False, 8), (True, 8), (False, 16))
    ],
    "mxfp8": [dict(CHUNKS=c, num_warps=w) for c, w in ((2, 1), (1, 1), (4, 1), (4, 2))],
    "mxfp8_dequantized": [dict(CHUNKS=c, num_warps=w) for c, w in ((1, 1), (2, 1), (1, 2))],
    "mxfp8_quads": [dict(CHUNKS=c, num_warps=w) for c, w in ((4, 1), (2, 1), (8, 1))] + [{}],
    "mxfp8_quads_dequantized": [dict(CHUNKS=c, num_warps=w) for c, w in ((1, 1), (2, 1), (4, 1))]
    + [{}],
    "mxfp8_dequant": [dict(CHUNKS=c, num_warps=w) for c, w in ((2, 1), (4, 1), (8, 2), (8, 1))],
}


def _outputs(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if result is None:
        return []
    if isinstance(result, dict):
        return _outputs(list(result.values()))
    flat = []
    for item in result:
        flat.extend(_outputs(item) if not isinstance(item, torch.Tensor) else [item])
    return flat


# Kernels that take over another's launches while configured: off while that one is swept.
SWEEP_WITHOUT = {
    "mxfp8_dequantized": "mxfp8_quads_dequantized",
}


def sweep_configs(reporter: Reporter, x: torch.Tensor, copy_gbps: float) -> None:
    """Time each candidate launch config; keep the fastest whose outputs equal the default's."""
    for key, candidates in SWEEP.items():
        other = SWEEP_WITHOUT.get(key)
        if other is not None:
            other_config = qc.tile_config(other)
            _set_tile(other, {})
        try:
            _sweep_one(reporter, x, copy_gbps, key, candidates)
        finally:
            if other is not None:
                _set_tile(other, other_config)
    linear_ops.clear_plans()  # Fp8Linear's prepared launches read the chosen configs
    chosen = {key: qc.tile_config(key) for key in qc.TILE_CONFIG}
    reporter.emit({"bench": "tile_config", "chosen": chosen})


def _set_tile(key: str, config: dict) -> None:
    """Override kernel `key`'s launch configuration through the FP8 debug config."""
    set_debug_config(tiles={**DEBUG.tiles, key: config})


def _sweep_one(
    reporter: Reporter, x: torch.Tensor, copy_gbps: float, key: str, candidates: list[dict]
) -> None:
    """Time TILE_CONFIG[key]'s candidates and keep the fastest with the default's bytes (the
    default, the first candidate, if one of them raises)."""
    best = None
    reference = None
    try:
        for config in candidates:
            _set_tile(key, config)
            linear_ops.clear_plans()
            fn, moved = _operand_fn(x, key)
            outputs = [t.clone() for t in _outputs(fn())]
            if reference is None:
                reference = outputs
            same = len(outputs) == len(reference) and all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(outputs, reference, strict=True)
            )
            gbps = moved / kernel_ms(fn) / 1e6
            reporter.emit(
                {
                    "bench": "sweep",
                    "kernel": key,
                    "config": config,
                    "gbps": round(gbps, 1),
                    "frac_of_copy": round(gbps / copy_gbps, 3),
                    "same_bytes": same,
                }
            )
            if same and (best is None or gbps > best[0]):
                best = (gbps, config)
    finally:
        _set_tile(key, best[1] if best is not None else candidates[0])


def bench_quantize(reporter: Reporter, *, sweep: bool) -> None:
    x = torch.randn(QUANT_SIZE, QUANT_SIZE, device="cuda", dtype=torch.bfloat16)
    copy_gbps = copy_bandwidth_gbps(x)
    reporter.emit({"bench": "copy", "shape": list(x.shape), "gbps": round(copy_gbps, 1)})
    if sweep:
        sweep_configs(reporter, x, copy_gbps)
    scale = torch.tensor(64.0, device="cuda")
    cases = []
    for name, kwargs, moved in _quant_cases(QUANT_SIZE):
        recipe = kwargs["recipe"]
        extra = {"scale": scale} if recipe == "delayed" else {}
        pow2 = recipe in ("blockwise", "mxfp8")

        def quantize_once(kwargs=kwargs, extra=extra, pow2=pow2):
            return quantize_cuda(x, fp8_dtype=E4M3, power_2_scale=pow2, **kwargs, **extra)

        cases.append((f"API {name}", quantize_once, moved))
    for name, key in (
        ("tensorwise amax + row+T", "tensorwise"),
        ("delayed row+T, amax in-kernel", "cast_t"),
        ("blockwise 1x128 row+T", "block_1x128_pair"),
        ("blockwise 128x128 row+T", "block_128x128"),
        ("mxfp8 dequantized row+col bf16", "mxfp8_dequantized"),
        ("mxfp8 dequantize bytes->bf16", "mxfp8_dequant"),
    ):
        fn, moved = _operand_fn(x, key)
        cases.append((f"Fp8Linear {name}", fn, moved))
    for name, fn, moved in cases:
        ms = kernel_ms(fn)
        gbps = moved / ms / 1e6
        reporter.emit(
            {
                "bench": "quantize",
                "case": name,
                "shape": list(x.shape),
                "time_us": round(ms * 1e3, 1),
                "bytes": moved,
                "gbps": round(gbps, 1),
                "frac_of_copy": round(gbps / copy_gbps, 3),
                "target": BANDWIDTH_TARGET,
                "pass": gbps / copy_gbps >= BANDWIDTH_TARGET,
                "triton": triton_available(),
            }
        )


def _quantize_for_chain(t, *, recipe, fp8_dtype, role, scale):
    """Rowwise operand + the transposed columnwise operand (data, scale_inv) of one tensor."""
    out = quantize_cuda(
        t,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=True,
        columnwise=True,
        with_transpose=True,
        scale=scale,
        power_2_scale=recipe in ("blockwise", "mxfp8"),
    )
    row = (out["rowwise_data"].view(fp8_dtype), out["rowwise_scale_inv"])
    col_sinv = out["columnwise_scale_inv"]
    if recipe not in ("delayed", "tensorwise"):
        col_sinv = col_sinv.t()  # the GEMM contracts over dim 0: transposed grid
    return row, (out["columnwise_data_t"].view(fp8_dtype), col_sinv)


def make_chain_step(x, w, dy, recipe):
    """fwd+bwd of Y = X W^T as quantize_cuda + 3 scaled_mm calls (what an ideal Fp8Linear
    does); mxfp8 GEMMs are emulated (dequantize to bf16, exact for normal values)."""
    scales = {"input": None, "weight": None, "grad": None}
    if recipe == "delayed":
        scales = {
            role: torch.tensor(s, device=x.device)
            for role, s in (("input", 64.0), ("weight", 1024.0), ("grad", 1024.0))
        }
    emulate = recipe == "mxfp8"
    mm = dict(
        recipe=recipe, out_dtype=torch.bfloat16, emulate=emulate, emulate_dtype=torch.bfloat16
    )
    fast = recipe in ("delayed", "tensorwise")

    def step():
        (x_row, x_col) = _quantize_for_chain(
            x, recipe=recipe, fp8_dtype=E4M3, role="input", scale=scales["input"]
        )
        (w_row, w_col) = _quantize_for_chain(
            w, recipe=recipe, fp8_dtype=E4M3, role="weight", scale=scales["weight"]
        )
        y = scaled_mm(
            x_row[0],
            w_row[0],
            a_scale_inv=x_row[1],
            b_scale_inv=w_row[1],
            use_fast_accum=fast,
            **mm,
        )
        (g_row, g_col) = _quantize_for_chain(
            dy, recipe=recipe, fp8_dtype=E5M2, role="grad", scale=scales["grad"]
        )
        dx = scaled_mm(
            g_row[0],
            w_col[0],
            a_scale_inv=g_row[1],
            b_scale_inv=w_col[1],
            use_fast_accum=False,
            **mm,
        )
        dw = scaled_mm(
            g_col[0],
            x_col[0],
            a_scale_inv=g_col[1],
            b_scale_inv=x_col[1],
            use_fast_accum=False,
            **mm,
        )
        return y, dx, dw

    return step


# Backward on the calling thread, as pretrain_gpt.py runs it (--backward-worker-threads there
# and here: on the autograd engine's device thread, PyTorch's default), for both sides.
BACKWARD_THREADS = {"worker": False}


def make_module_step(module, x, dy, *, autocast):
    def step():
        x.grad = None
        module.weight.grad = None
        if autocast is None:
            y = module(x)
        else:
            with autocast(module):
                y = module(x)
        with torch.autograd.set_multithreading_enabled(BACKWARD_THREADS["worker"]):
            y.backward(dy)

    return step


def _fp8_linear_step(recipe, k, n, x, dy):
    """Fp8Linear fwd+bwd step, or (None, reason) when it cannot be built or run here."""
    try:
        from megatron.core.fp8 import Fp8Config, Fp8Linear, fp8_autocast

        module = Fp8Linear(
            k,
            n,
            bias=False,
            fp8_config=Fp8Config(recipe=recipe),
            dtype=torch.bfloat16,
            device="cuda",
        )
        step = make_module_step(module, x, dy, autocast=fp8_autocast)
        step()
        return step, None
    except Exception as err:  # noqa: BLE001 - the report must say why, not crash the run
        return None, f"{type(err).__name__}: {str(err)[:160]}"


def _profile_step(step, label: str) -> str:
    """Top GPU kernels of one step (torch.profiler), as text for $OUT/profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
    )
    return f"== {label}\n{table}\n"


def round_speedups(bf16_ms: list[float], fp8_ms: list[float]) -> tuple[list[float], float]:
    """(each round's bf16/FP8 time ratio, their median): the speedup bench_linear reports,
    taken within rounds rather than as a ratio of medians, so a drift between rounds cancels."""
    ratios = [b / t for b, t in zip(bf16_ms, fp8_ms, strict=True)]
    return ratios, statistics.median(ratios)


def bench_linear(
    reporter: Reporter,
    started: float,
    *,
    chain: bool,
    budget_s: float,
    profile_path: Path | None,
    shapes=LINEAR_SHAPES,
    recipes=RECIPES,
    rounds: int = ROUNDS,
) -> None:
    """Time bf16 nn.Linear and each recipe's Fp8Linear (and --chain's API chain) in
    `rounds` interleaved rounds: every round times each step once (steady_ms), bf16 first.
    An H200's step times drift by up to 18% within a run (clocks, host speed), so each
    speedup is the median of the rounds' own ratios, both sides measured seconds apart."""
    for k, n in shapes:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        cases = [("bf16 nn.Linear", "bf16", make_module_step(base, x, dy, autocast=None))]
        w = base.weight.detach()
        for recipe in recipes:
            if time.perf_counter() - started > budget_s:
                reporter.emit(
                    {"bench": "linear", "recipe": recipe, "K": k, "N": n, "skipped": "time budget"}
                )
                continue
            module_step, why = _fp8_linear_step(recipe, k, n, x, dy)
            if module_step is not None:
                cases.append(("Fp8Linear", recipe, module_step))
            else:
                reporter.emit(
                    {
                        "bench": "linear",
                        "impl": "Fp8Linear",
                        "recipe": recipe,
                        "K": k,
                        "N": n,
                        "unavailable": why,
                    }
                )
            if chain:
                cases.append(
                    ("quantize_cuda+scaled_mm", recipe, make_chain_step(x.detach(), w, dy, recipe))
                )
        times: list[list[float]] = [[] for _ in cases]
        hosts: list[list[float]] = [[] for _ in cases]
        for _ in range(rounds):
            for index, (_, _, step) in enumerate(cases):
                host: list[float] = []
                times[index].append(steady_ms(step, host=host))
                hosts[index].append(host[0])
        graphs = [graph_ms(step) for _, _, step in cases]
        bf16_ms, bf16_graph = statistics.median(times[0]), graphs[0]
        reporter.emit(
            {
                "bench": "linear",
                "impl": "bf16 nn.Linear",
                "recipe": "bf16",
                "M": TOKENS,
                "K": k,
                "N": n,
                "time_ms": round(bf16_ms, 3),
                "round_ms": [round(t, 3) for t in times[0]],
                "host_ms": round(statistics.median(hosts[0]), 3),
                "graph_ms": _round(bf16_graph),
            }
        )
        for index in range(1, len(cases)):
            impl, recipe, step = cases[index]
            ratios, speedup = round_speedups(times[0], times[index])
            graphed = graphs[index]
            graph_speedup = (bf16_graph / graphed) if (graphed and bf16_graph) else None
            reporter.emit(
                {
                    "bench": "linear",
                    "impl": impl,
                    "recipe": recipe,
                    "M": TOKENS,
                    "K": k,
                    "N": n,
                    "time_ms": round(statistics.median(times[index]), 3),
                    "round_ms": [round(t, 3) for t in times[index]],
                    "round_speedups": [round(r, 3) for r in ratios],
                    "host_ms": round(statistics.median(hosts[index]), 3),
                    "graph_ms": _round(graphed),
                    "bf16_ms": round(bf16_ms, 3),
                    "bf16_graph_ms": _round(bf16_graph),
                    "speedup": round(speedup, 3),
                    "graph_speedup": _round(graph_speedup),
                    "target": SPEEDUP_TARGET[recipe],
                    "pass": speedup >= SPEEDUP_TARGET[recipe],
                    "gemm_path": _gemm_path(recipe),
                    "launch": direct_launch_status(),
                }
            )
            if profile_path is not None and impl == "Fp8Linear" and (k, n) == shapes[0]:
                with profile_path.open("a") as handle:
                    handle.write(_profile_step(step, f"Fp8Linear {recipe} K={k} N={n}"))
        del x, dy, base, w, cases
        torch.cuda.empty_cache()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _gemm_path(recipe: str) -> str:
    if recipe == "blockwise":
        return blockwise_gemm_path()
    if recipe == "mxfp8":
        return "emulated (dequantize to bf16 + bf16 GEMM)"
    return "torch._scaled_mm tensorwise"


def print_table(rows: list[dict]) -> None:
    print("\n== summary ==")
    for row in rows:
        if row["bench"] == "check":
            print(
                f"check     {row['cases']} cases, {row['mismatches']} mismatches "
                f"({'PASS' if row['pass'] else 'FAIL'})"
            )
        elif row["bench"] == "copy":
            print(f"copy      d2d bandwidth {row['gbps']} GB/s")
        elif row["bench"] == "quantize":
            print(
                f"quantize  {row['case']:<38} {row['time_us']:>9.1f} us {row['gbps']:>8.1f} "
                f"GB/s {100 * row['frac_of_copy']:5.1f}% of copy "
                f"{'PASS' if row['pass'] else 'below 60%'}"
            )
        elif row["bench"] == "sweep":
            print(
                f"sweep     {row['kernel']:<14} {json.dumps(row['config']):<44} "
                f"{100 * row['frac_of_copy']:5.1f}% of copy same_bytes={row['same_bytes']}"
            )
        elif row["bench"] == "tile_config":
            print(f"chosen    {json.dumps(row['chosen'])}")
        elif "time_ms" in row and row["recipe"] == "bf16":
            print(
                f"linear    bf16 nn.Linear K={row['K']:<6} N={row['N']:<6} "
                f"{row['time_ms']:>8.3f} ms (host {row['host_ms']:.3f} ms, graph "
                f"{row['graph_ms']} ms)"
            )
        elif "time_ms" in row:
            print(
                f"linear    {row['recipe']:<10} {row['impl']:<10} K={row['K']:<6} "
                f"N={row['N']:<6} {row['time_ms']:>8.3f} ms (host {row['host_ms']:.3f}) "
                f"vs bf16 {row['bf16_ms']:.3f} ms "
                f"= {row['speedup']:.2f}x (rounds {min(row['round_speedups']):.2f}-"
                f"{max(row['round_speedups']):.2f}x, target {row['target']}x) "
                f"{'PASS' if row['pass'] else 'MISS'}; graphed {row['graph_speedup']}x "
                f"[{row['gemm_path']}]"
            )
        elif "unavailable" in row or "skipped" in row:
            print(
                f"linear    {row['recipe']:<10} {row.get('impl', '')}: "
                f"{row.get('unavailable') or row.get('skipped')}"
            )


def _parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple(tuple(int(v) for v in item.split("x")) for item in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(shape) != 2 or min(shape) <= 0 for shape in shapes):
        raise argparse.ArgumentTypeError(f"expected KxN[,KxN...] with positive sizes, got {text!r}")
    return shapes


def _parse_recipes(text: str) -> tuple[str, ...]:
    recipes = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [recipe for recipe in recipes if recipe not in RECIPES]
    if not recipes or unknown:
        choices = ", ".join(RECIPES)
        raise argparse.ArgumentTypeError(f"recipes must be among {choices}; got {text!r}")
    return recipes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="first compare quantize_cuda bitwise with the reference on random "
        "and edge-case inputs; exit 1 on any mismatch",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time alternative launch configs per kernel and use the fastest",
    )
    parser.add_argument(
        "--chain",
        action="store_true",
        help="also time the quantize_cuda + scaled_mm API chain per recipe",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write the top GPU kernels of one Fp8Linear step to $OUT/profile.txt",
    )
    parser.add_argument(
        "--backward-worker-threads",
        action="store_true",
        help="run Linear backward on the autograd engine's device thread (PyTorch's default) "
        "instead of the calling thread (pretrain_gpt.py's default), for both sides",
    )
    parser.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=LINEAR_SHAPES,
        help="Linear (K, N) shapes as KxN,KxN (default: the three of the FP8 issue)",
    )
    parser.add_argument(
        "--recipes",
        type=_parse_recipes,
        default=RECIPES,
        help="comma-separated recipes for the Linear comparison (default: all four)",
    )
    parser.add_argument(
        "--no-quantize",
        action="store_true",
        help="skip the quantization bandwidth table (and --sweep): Linear comparison only",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=TIME_BUDGET_S,
        help="start no new Linear case after this many seconds",
    )
    args = parser.parse_args()
    BACKWARD_THREADS["worker"] = args.backward_worker_threads
    if not torch.cuda.is_available():
        print("bench_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    reporter = Reporter()
    reporter.emit(
        {
            "bench": "env",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "triton": triton_available(),
            "backward_worker_threads": args.backward_worker_threads,
        }
    )
    if args.check and not run_check(reporter):
        print_table(reporter.rows)
        return 1
    if not args.no_quantize:
        bench_quantize(reporter, sweep=args.sweep)
    out_dir = os.environ.get("OUT")
    profile_path = Path(out_dir) / "profile.txt" if (args.profile and out_dir) else None
    bench_linear(
        reporter,
        started,
        chain=args.chain,
        budget_s=args.budget_s,
        profile_path=profile_path,
        shapes=args.shapes,
        recipes=args.recipes,
    )
    reporter.emit(
        {
            "bench": "done",
            "seconds": round(time.perf_counter() - started, 1),
            "blockwise_gemm_path": blockwise_gemm_path(),
        }
    )
    print_table(reporter.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
