"""Summarize a torch.profiler Chrome trace (pretrain_gpt.py --profile --use-pytorch-profiler):
GPU kernel time by kernel name (largest first), memcpy/memset totals, and how much of the
profiled span the GPU was busy; with --cpu, host time by op name and the kernel launches.
Usage: python dev/trace_summary.py TRACE.json[.gz] [--top N] [--cpu]
"""

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union length of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def cpu_summary(events: list[dict], top: int) -> None:
    """Host time (inclusive: an op's time includes the ops it calls) and calls by op name, of
    torch ops and annotations (custom ops, compiled regions, ProfilerStep#k), largest first,
    with the kernel launches counted."""
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in host:
        row = by_name[e["name"][:110]]
        row[0] += e["dur"]
        row[1] += 1
    launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e["name"])
    print(f"kernel launches (cudaLaunchKernel / cuLaunchKernel...): {launches}")
    print(f"{'ms':>9} {'calls':>7}  name (inclusive host time)")
    for name, (dur, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{dur / 1e3:9.2f} {calls:7d}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cpu", action="store_true", help="host time by op name instead")
    args = parser.parse_args()
    events = [e for e in load(args.trace) if e.get("ph") == "X" and "dur" in e]
    if args.cpu:
        cpu_summary(events, args.top)
        return
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        row = by_name[(e["cat"], e["name"][:110])]
        row[0] += e["dur"]
        row[1] += 1
    total = sum(v[0] for v in by_name.values())
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    print(
        f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), "
        f"kernel time summed {total / 1e3:.1f} ms"
    )
    for cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        t = sum(v[0] for k, v in by_name.items() if k[0] == cat)
        print(f"  {cat}: {t / 1e3:.1f} ms")
    print(f"{'ms':>9} {'%':>6} {'calls':>6}  name")
    for (_cat, name), (dur, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{dur / 1e3:9.2f} {100 * dur / total:6.2f} {calls:6d}  {name}")


if __name__ == "__main__":
    main()
