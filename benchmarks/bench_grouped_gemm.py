"""The MoE experts' grouped GEMMs on one GPU: bf16 torch._grouped_mm, FP8 rowwise
torch._scaled_grouped_mm (torch's, where it exists) and ours (fp8/cuda/grouped_gemm.py,
tensorwise and blockwise), forward (fc1, fc2) and weight gradient, in TFLOP/s; each of ours
also checked against its exact emulation (largest error relative to the largest value).

    python3 benchmarks/bench_grouped_gemm.py --out /tmp/gg.jsonl
    python3 benchmarks/bench_grouped_gemm.py --experts 128 --topk 8 --hidden 2048 --ffn 768

Default shape: 8,192 tokens routed top-8 over 64 experts (65,536 rows, 1,024 per expert on
average, drawn with a mild imbalance), hidden 2048, expert FFN 1408 (SwiGLU: fc1 2 x 1408).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.fp8 import Fp8Config  # noqa: E402
from megatron.core.fp8.cuda import grouped_gemm  # noqa: E402
from megatron.core.fp8.cuda.grouped_gemm import (  # noqa: E402
    group_offsets,
    grouped_scaled_mm,
    grouped_scaled_mm_wgrad,
    tile_schedule,
)
from megatron.core.fp8.quantization import quantize  # noqa: E402
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def timed_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def group_sizes(tokens: int, experts: int, topk: int, seed: int = 0) -> list[int]:
    """tokens * topk rows over the experts, with a mild (Dirichlet) imbalance."""
    torch.manual_seed(seed)
    share = torch.distributions.Dirichlet(torch.full((experts,), 8.0)).sample()
    sizes = (share * tokens * topk).floor().long()
    sizes[0] += tokens * topk - int(sizes.sum())
    return sizes.tolist()


def fp8(x: torch.Tensor, recipe: str, role: str, dtype=E4M3):
    q = quantize(x, recipe=recipe, fp8_dtype=dtype, role=role)
    return q.rowwise_data.view(dtype), q.rowwise_scale_inv


def stacked_fp8(w: torch.Tensor, recipe: str):
    parts = [fp8(w[g], recipe, "weight") for g in range(w.shape[0])]
    scale = torch.stack([p[1] for p in parts])
    return torch.stack([p[0] for p in parts]), scale.reshape(-1) if scale.dim() == 1 else scale


def timed_row(gemm: str, impl: str, fn) -> dict:
    """{gemm, impl, ms}, or the error torch raised for this layout."""
    try:
        return dict(gemm=gemm, impl=impl, ms=timed_ms(fn))
    except (RuntimeError, TypeError, ValueError) as err:
        return dict(gemm=gemm, impl=impl, error=str(err)[:200])


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def forward_rows(name: str, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> list[dict]:
    """x [M, K] bf16, w [G, N, K] bf16: bf16, torch FP8 rowwise, ours."""
    flops = 2 * x.shape[0] * w.shape[1] * w.shape[2]
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    rows = [
        timed_row(
            name,
            "bf16 torch._grouped_mm",
            lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
        )
    ]
    if hasattr(torch, "_scaled_grouped_mm"):
        xa = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448
        wa = w.abs().amax(dim=2).float().clamp(min=1e-12) / 448
        xq = (x.float() / xa).to(E4M3)
        wq = (w.float() / wa.unsqueeze(-1)).to(E4M3).transpose(1, 2)
        sa, sb = xa.reshape(-1), wa

        def torch_fp8():
            return torch._scaled_grouped_mm(
                xq, wq, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
            )

        rows.append(timed_row(name, "fp8 rowwise torch._scaled_grouped_mm", torch_fp8))
    # As the layer calls it: sizes on the device and the tile schedule built once per layer
    # call (not per GEMM), so the time is the kernel's, not a host list's copy and schedule.
    device_sizes = torch.tensor(sizes, device=x.device)
    schedule = tile_schedule(device_sizes, x.shape[0])
    for recipe, fast in (("tensorwise", True), ("tensorwise", False), ("blockwise", False)):
        a, a_scale = fp8(x, recipe, "input")
        b, b_scale = stacked_fp8(w, recipe)
        kwargs = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=sizes, recipe=recipe)
        timed = dict(kwargs, group_sizes=device_sizes, schedule=schedule, fast_accum=fast)
        ms = timed_ms(functools.partial(grouped_scaled_mm, a, b, **timed))
        error = _rel_error(
            grouped_scaled_mm(a, b, out_dtype=torch.float32, fast_accum=fast, **kwargs),
            grouped_scaled_mm(a, b, out_dtype=torch.float32, emulate=True, **kwargs),
        )
        mode = "fast" if fast else "precise"
        rows.append(dict(gemm=name, impl=f"ours fp8 {recipe} {mode}", ms=ms, rel_error=error))
    for row in rows:
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
    return rows


def wgrad_rows(x: torch.Tensor, dy: torch.Tensor, sizes: list[int]) -> list[dict]:
    """dW[g] = dy[g]^T x[g] ([G, N, K]) for fc2-shaped operands: bf16 against ours."""
    flops = 2 * x.shape[0] * x.shape[1] * dy.shape[1]
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    rows = [
        timed_row(
            "wgrad", "bf16 torch._grouped_mm", lambda: torch._grouped_mm(dy.t(), x, offs=offs)
        )
    ]
    a, a_scale = fp8(dy.t().contiguous(), "tensorwise", "grad", E5M2)
    b, b_scale = fp8(x.t().contiguous(), "tensorwise", "input")
    kwargs = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=sizes, recipe="tensorwise")
    for fast in (True, False):
        ms = timed_ms(lambda fast=fast: grouped_scaled_mm_wgrad(a, b, fast_accum=fast, **kwargs))
        error = _rel_error(
            grouped_scaled_mm_wgrad(a, b, fast_accum=fast, **kwargs),
            grouped_scaled_mm_wgrad(a, b, emulate=True, **kwargs),
        )
        impl = f"ours fp8 tensorwise {'fast' if fast else 'precise'}"
        rows.append(dict(gemm="wgrad", impl=impl, ms=ms, rel_error=error))
    rows += _whole_tile_wgrad_rows(a, b, kwargs)
    for row in rows:
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
    return rows


def _whole_tile_wgrad_rows(a: torch.Tensor, b: torch.Tensor, kwargs: dict) -> list[dict]:
    """The layer's wgrad path: each group's tokens padded to whole 128-token tiles (zero
    columns), unmasked aligned loads (`whole_tiles`); TFLOP/s counted on the real tokens."""
    sizes = kwargs["group_sizes"]
    padded = [-(-size // 128) * 128 for size in sizes]
    starts, padded_starts = [0], [0]
    for size, pad in zip(sizes, padded):
        starts.append(starts[-1] + size)
        padded_starts.append(padded_starts[-1] + pad)
    operands = []
    for t in (a, b):
        raw = t.view(torch.uint8)
        out = raw.new_zeros(raw.shape[0], padded_starts[-1])
        for g, size in enumerate(sizes):
            out[:, padded_starts[g] : padded_starts[g] + size] = raw[:, starts[g] : starts[g + 1]]
        operands.append(out.view(t.dtype))
    whole = dict(kwargs, group_sizes=padded, whole_tiles=True)
    want = grouped_scaled_mm_wgrad(a, b, emulate=True, **kwargs)
    device_sizes = torch.tensor(padded, device=a.device)  # as the layer passes them
    timed = dict(whole, group_sizes=device_sizes, offsets=group_offsets(device_sizes))
    rows = []
    # fp32 out, pointers and TMA; and bf16 out (the weight's dtype: what training writes)
    for loads, out in (
        ("pointers", torch.float32),
        ("tma", torch.float32),
        ("tma", torch.bfloat16),
    ):
        with mock.patch.object(grouped_gemm, "_tma_runs", lambda device, on=loads == "tma": on):
            ms = timed_ms(lambda o=out: grouped_scaled_mm_wgrad(*operands, **timed, out_dtype=o))
            got = grouped_scaled_mm_wgrad(*operands, **whole, out_dtype=out)
            error = _rel_error(got.float(), want)
        impl = f"ours fp8 tensorwise precise, whole 128-token tiles, {loads}, {str(out)[6:]} out"
        rows.append(dict(gemm="wgrad", impl=impl, ms=ms, rel_error=error))
    return rows


def layer_rows(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> list[dict]:
    """Fp8StackedLinear (tensorwise and blockwise, bf16) forward + backward: the one grouped
    function (moe/grouped_fp8.py) against the per-segment reference path, each fp8 format;
    TFLOP/s counts the three GEMMs."""
    rows = []
    for recipe, fp8_format in (
        ("tensorwise", "hybrid"),
        ("tensorwise", "e4m3"),
        ("blockwise", "hybrid"),
    ):
        config = Fp8Config(recipe=recipe, fp8_format=fp8_format)
        experts, out_features, in_features = w.shape
        layer = Fp8StackedLinear(
            experts, in_features, out_features, fp8_config=config, dtype=w.dtype, device=w.device
        )
        with torch.no_grad():
            layer.weight.copy_(w)
        tokens = x.detach().requires_grad_()
        for grouped in (True, False):
            layer.grouped = grouped

            def step(layer=layer, tokens=tokens):
                layer(tokens, sizes).backward(torch.ones_like(tokens[:, :1]).expand(-1, w.shape[1]))

            path = "grouped" if grouped else "per_segment"
            impl = f"stacked_linear_{path}_{fp8_format}" + (
                "_blockwise" if recipe == "blockwise" else ""
            )
            row = timed_row("fc1_fwd_bwd", impl, step)
            if "ms" in row:
                row["tflops"] = round(6 * x.shape[0] * w.shape[1] * w.shape[2] / row["ms"] / 1e9, 1)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    sizes = group_sizes(args.tokens, args.experts, args.topk)
    rows_total = sum(sizes)
    device = "cuda"
    x = torch.randn(rows_total, args.hidden, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(args.experts, 2 * args.ffn, args.hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(rows_total, args.ffn, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(args.experts, args.hidden, args.ffn, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows_total, args.hidden, device=device, dtype=torch.bfloat16)
    results = forward_rows("fc1", x, w1 * 0.02, sizes) + forward_rows("fc2", h, w2 * 0.02, sizes)
    results += wgrad_rows(h, dy, sizes)
    results += layer_rows(x, w1 * 0.02, sizes)
    shape = dict(vars(args), rows=rows_total, min_group=min(sizes), max_group=max(sizes))
    lines = [json.dumps(dict(row, **shape)) for row in results]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
