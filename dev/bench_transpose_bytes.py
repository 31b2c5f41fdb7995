"""Byte transposes of the FP8 MoE path on a GPU (issue 38: `_transpose_bytes_kernel` was 28% of
the GPU time of model M-small's tensorwise step, 0.23 ms a call): the product's
`transpose_bytes` (plain, and gathering token rows into a padded copy by a source list)
against torch (eager and compiled),
a copy of the same bytes (the bandwidth bound) and tile/warp variants of a gather-form kernel
(each output tile reads the source rows its columns come from: loads and stores both along
contiguous bytes, no zero fill first). Every variant is checked against torch's transpose.

    python dev/bench_transpose_bytes.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.core.fp8.cuda.grouped_gemm import transpose_bytes  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the script needs a GPU anyway
    triton = None


if triton is not None:

    @triton.jit
    def _gather_transpose(src, dst, inv, rows, cols, length, BP: tl.constexpr, BC: tl.constexpr):
        """dst[c, p] = src[inv[p], c] (0 where inv[p] < 0 or p >= length)."""
        p = tl.program_id(0) * BP + tl.arange(0, BP)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        source = tl.load(inv + p, mask=p < length, other=-1)
        ok = (source >= 0)[:, None] & (c[None, :] < cols)
        tile = tl.load(src + source.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0)
        out = dst + c.to(tl.int64)[:, None] * length + p[None, :]
        tl.store(out, tl.trans(tile), mask=(c[:, None] < cols) & (p[None, :] < length))


def timed_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def padded_layout(rows: int, experts: int, tile: int = 128):
    """Positions of `rows` tokens in experts' segments padded to whole tiles, and the inverse."""
    sizes = torch.full((experts,), rows // experts)
    sizes[: rows - int(sizes.sum())] += 1
    padded = (sizes + tile - 1) // tile * tile
    starts = torch.cumsum(padded, 0) - padded
    position = torch.cat([starts[e] + torch.arange(int(sizes[e])) for e in range(experts)])
    length = int(padded.sum())
    inverse = torch.full((length,), -1, dtype=torch.int32)
    inverse[position] = torch.arange(rows, dtype=torch.int32)
    return position.cuda(), inverse.cuda(), length


def gather_rows(src, inverse, length, bp, bc, warps) -> torch.Tensor:
    rows, cols = src.shape
    out = torch.empty(cols, length, dtype=torch.uint8, device=src.device)
    grid = (triton.cdiv(length, bp), triton.cdiv(cols, bc))
    _gather_transpose[grid](src, out, inverse, rows, cols, length, BP=bp, BC=bc, num_warps=warps)
    return out


def case_rows(name: str, src: torch.Tensor, positioned: bool) -> list[dict]:
    """Rows of one operand: src uint8 [R, C] (2-D, positioned) or [B, R, C]."""
    moved = 2 * src.numel()
    results = []

    def row(impl, fn, reference=None):
        ms = timed_ms(fn)
        ok = reference is None or torch.equal(fn(), reference)
        entry = dict(case=name, shape=list(src.shape), impl=impl, ms=round(ms, 4))
        entry.update(gbps=round(moved / ms / 1e6, 1), exact=ok)
        results.append(entry)
        print(json.dumps(entry), flush=True)

    row("copy (bound)", lambda: src.clone())
    if not positioned:
        reference = src.transpose(-2, -1).contiguous()
        row("product transpose_bytes", lambda: transpose_bytes(src), reference)
        row("torch eager t().contiguous()", lambda: src.transpose(-2, -1).contiguous(), reference)
        compiled = torch.compile(lambda t: t.transpose(-2, -1).contiguous())
        row("torch.compile transpose", lambda: compiled(src), reference)
        return results
    position, inverse, length = padded_layout(src.shape[0], 64)
    padded = src.new_zeros(length, src.shape[1]).index_copy_(0, position, src)
    reference = padded.t().contiguous()
    row("product transpose_bytes(source)", lambda: transpose_bytes(src, inverse), reference)

    def eager():
        return src.new_zeros(length, src.shape[1]).index_copy_(0, position, src).t().contiguous()

    row("torch eager pad + t()", eager, reference)
    for bp, bc, warps in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8)):
        tiles = dict(bp=bp, bc=bc, warps=warps)
        row(
            f"gather {bp}x{bc} w{warps}",
            lambda t=tiles: gather_rows(src, inverse, length, **t),
            reference,
        )  # noqa: E501
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("needs a CUDA GPU and triton")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)

    def bytes_of(*shape):
        return torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=gen)

    results = []
    # model M-small (hidden 768, expert ffn 256, 4096 tokens x top-8) and model M (2048, 768).
    for hidden, ffn, tokens in ((768, 256, 4096), (2048, 768, 8192)):
        routed = tokens * 8
        tag = f"h{hidden}_f{ffn}"
        results += case_rows(f"{tag} x", bytes_of(routed, hidden), True)
        results += case_rows(f"{tag} dy_fc1", bytes_of(routed, 2 * ffn), True)
        results += case_rows(f"{tag} w_fc1", bytes_of(64, 2 * ffn, hidden), False)
        results += case_rows(f"{tag} w_fc2", bytes_of(64, hidden, ffn), False)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
