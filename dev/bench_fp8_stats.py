"""Time and peak memory of one --log-fp8-stats pass (`fp8_stats_vector`) over Model A-shaped
bf16 operands, per recipe and role: the formulas before the chunked passes ("old": full-size
fp32 temporaries, a quantize + dequantize), the chunked passes in eager torch ("eager") and
compiled, one kernel per chunk pass ("fused", the default on CUDA). Checks that all three give
the same vector. Prints one JSON line; the first call of each case (compiling) is not timed
but reported as first_ms.

    python3 dev/bench_fp8_stats.py                      # H200: 8192x4096 and 8192x14336
    python3 dev/bench_fp8_stats.py --device cpu --shapes 256x512 --iters 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from megatron.core import fused_pass
from megatron.core.fp8.stats import fp8_stats_vector
from tests.unit_tests.fp8.test_fp8_stats_chunked import old_stats_vector

VARIANTS = {"old": (old_stats_vector, False), "eager": (fp8_stats_vector, False)}
VARIANTS["fused"] = (fp8_stats_vector, True)


def _timed(fn, device: str) -> float:
    """Milliseconds of fn() (synchronized on CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _case(x, *, recipe: str, role: str, variant: str, iters: int) -> tuple[dict, list[float]]:
    function, fused = VARIANTS[variant]
    with mock.patch.object(fused_pass, "fused_on", lambda device: fused):
        return _measured(x, function, recipe=recipe, role=role, iters=iters)


def _measured(x, function, *, recipe: str, role: str, iters: int) -> tuple[dict, list[float]]:
    scale = torch.tensor(0.5, device=x.device) if recipe == "delayed" else None
    out = {}

    def call() -> None:
        out["vector"] = function(x, recipe=recipe, role=role, scale=scale)

    device = x.device.type
    first = _timed(call, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    times = [_timed(call, device) for _ in range(iters)]
    row = dict(first_ms=round(first, 2), median_ms=round(statistics.median(times), 3))
    if device == "cuda":
        row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    return row, out["vector"].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["8192x4096", "8192x14336"])
    recipes = ["tensorwise", "blockwise", "mxfp8", "delayed"]
    parser.add_argument("--recipes", nargs="+", default=recipes)
    parser.add_argument("--roles", nargs="+", default=["input", "weight", "grad"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows, totals = [], {variant: 0.0 for variant in args.variants}
    for shape in args.shapes:
        size = tuple(int(n) for n in shape.split("x"))
        x = torch.randn(size, generator=gen).to(args.device, torch.bfloat16)
        x[0, :7] = 0.0
        for recipe in args.recipes:
            for role in args.roles:
                vectors = {}
                for variant in args.variants:
                    row, vectors[variant] = _case(
                        x, recipe=recipe, role=role, variant=variant, iters=args.iters
                    )
                    totals[variant] += row["median_ms"]
                    rows.append(dict(shape=shape, recipe=recipe, role=role, variant=variant, **row))
                same = all(v == next(iter(vectors.values())) for v in vectors.values())
                rows[-1]["all_variants_equal"] = same
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    summary = {variant: round(ms, 2) for variant, ms in totals.items()}
    print(json.dumps(dict(device=device, total_median_ms=summary, rows=rows)))


if __name__ == "__main__":
    main()
