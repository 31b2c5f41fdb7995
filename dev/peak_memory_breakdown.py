"""What is alive at the peak of a CUDA memory trace, grouped by the code that allocated it.

Question it answers: which tensors make up a run's `max_memory_allocated` (issue 19: the FP8
rows of Model A peak 0.7 GiB above FSDP2's). Input: a snapshot written by
`pretrain_gpt.py --record-memory-history --memory-snapshot-path FILE` (or any
`torch.cuda.memory._dump_snapshot` pickle). The allocation trace is replayed; at the moment the
live bytes are largest, the live blocks are summed by their innermost frame inside this
repository (or the innermost frame at all, when none is ours).

    python3 dev/peak_memory_breakdown.py snapshot.pickle [--top 25] [--depth 1]

--depth N names each site by its N innermost frames here (who called the allocating code). A
compiled graph's allocation carries the stack recorded when the graph was traced: a backward
node's callers are its forward's (e.g. `backward <- grouped_fp8_linear`), not who ran it.

Runs on CPU (it only reads the pickle).
"""

from __future__ import annotations

import argparse
import os
import pickle
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name(frame: dict) -> str:
    path = os.path.relpath(frame.get("filename", ""), REPO)
    return f"{path}:{frame.get('line')} {frame.get('name')}"


def _site(frames: list[dict], depth: int = 1) -> str:
    """The `depth` innermost frames in this repository ("inner <- caller"), else the innermost
    frame, as file:line name."""
    ours = [
        _name(frame)
        for frame in frames
        if frame.get("filename", "").startswith(REPO) or "/megatron/" in frame.get("filename", "")
    ]
    if ours:
        return " <- ".join(ours[:depth])
    if frames:
        frame = frames[0]
        return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"
    return "(no stack recorded)"


def peak_breakdown(snapshot: dict, device: int = 0, depth: int = 1) -> tuple[int, dict[str, int]]:
    """(peak live bytes, {allocation site: bytes alive at the peak}) of one device's trace;
    a site is its `depth` innermost frames in this repository.

    Blocks allocated before the trace window opened count as "(before the trace)": those still
    allocated at the dump (in `segments`, never allocated in the trace) and those the trace
    frees without having allocated them (the ring buffer dropped their allocation)."""
    trace = snapshot["device_traces"][device]
    traced = {entry["addr"] for entry in trace if entry["action"] == "alloc"}
    live: dict[int, tuple[int, str]] = {}
    # The trace is a ring buffer (max_entries): a block freed inside it whose allocation fell
    # off its start was live when the window opened.
    seen: set[int] = set()
    for entry in trace:
        address = entry["addr"]
        if entry["action"] == "alloc":
            seen.add(address)
        elif entry["action"] in ("free_requested", "free_completed") and address not in seen:
            live[address] = (entry["size"], "(before the trace)")
            seen.add(address)
    known = traced | set(live)
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            address = block.get("address")
            if block.get("state") == "active_allocated" and address not in known:
                live[address] = (block["size"], "(before the trace)")
    total = sum(size for size, _ in live.values())
    peak, at_peak = total, dict(live)
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = (entry["size"], _site(entry.get("frames", []), depth))
            total += entry["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and entry["addr"] in live:
            # A block is free from its first free event (the request; traces that record only
            # the completion count that).
            total -= live.pop(entry["addr"])[0]
    by_site: dict[str, int] = defaultdict(int)
    for size, site in at_peak.values():
        by_site[site] += size
    return peak, dict(by_site)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--depth", type=int, default=1, help="repository frames per site (callers too)"
    )
    args = parser.parse_args()
    if args.depth < 1:
        parser.error(f"--depth must be at least 1, got {args.depth}")
    with open(args.snapshot, "rb") as handle:
        snapshot = pickle.load(handle)
    peak, by_site = peak_breakdown(snapshot, args.device, args.depth)
    print(f"peak live: {peak / 2**30:.3f} GiB")
    for site, size in sorted(by_site.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{size / 2**30:9.3f} GiB  {site}")


if __name__ == "__main__":
    main()
