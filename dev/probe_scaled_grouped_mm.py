"""What torch's FP8 grouped GEMM (`torch._scaled_grouped_mm`) accepts and how fast it is here,
for the MoE experts' three GEMMs: forward/dgrad (2d x 3d, ragged M) with a per-row A scale and a
per-(expert, column) B scale -- which carries our per-tensor recipes (one scale per expert weight,
one per token segment) -- and wgrad (2d x 2d, ragged K); E4M3 and E5M2 operands. Each case: the
error against the dequantized fp64 product (largest |error| / largest |value|) and TFLOP/s, or
the error torch raised. One JSON line per case.

    python3 dev/probe_scaled_grouped_mm.py            # default MoE shape of bench_grouped_gemm.py
    python3 dev/probe_scaled_grouped_mm.py --ffn 768  # model M's experts
"""

from __future__ import annotations

import json
import sys

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def timed_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def rowwise(x: torch.Tensor, dtype: torch.dtype, dim: int):
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale_inv = amax / torch.finfo(dtype).max
    return (x.float() / scale_inv).to(dtype), scale_inv


def case(name: str, fn, reference, flops: float) -> dict:
    try:
        got = fn().double()
        want = reference()
        error = ((got - want).abs().max() / want.abs().max()).item()
        ms = timed_ms(fn)
        return dict(case=name, rel_error=error, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
    except Exception as err:  # noqa: BLE001 - what torch refuses is the finding
        return dict(case=name, error=f"{type(err).__name__}: {str(err)[:240]}")


def forward_cases(m: int, n: int, k: int, sizes: list[int], a_dtype) -> list[dict]:
    g = len(sizes)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, xs = rowwise(x, a_dtype, 1)
    wq, ws = rowwise(w, E4M3, 2)  # [g, n, 1]
    # per-tensor per expert: one scale per weight, broadcast over its columns
    wt_s = w.abs().amax(dim=(1, 2)).float() / 448
    wtq = (w.float() / wt_s[:, None, None]).to(E4M3)

    def ref(aq, as_, bq, bs):
        a = aq.double() * as_.double().reshape(-1, 1)
        rows, start = [], 0
        for e, size in enumerate(sizes):
            b = bq[e].double() * bs[e].double().reshape(-1, 1)
            rows.append(a[start : start + size] @ b.t())
            start += size
        return torch.cat(rows)

    tag = "e5m2" if a_dtype == E5M2 else "e4m3"
    out = []
    for label, bq, bs in (
        ("rowwise", wq, ws.reshape(g, n)),
        ("per_expert", wtq, wt_s[:, None].expand(g, n).contiguous()),
    ):
        fn = lambda bq=bq, bs=bs: torch._scaled_grouped_mm(  # noqa: E731
            xq,
            bq.transpose(1, 2),
            xs.reshape(-1),
            bs,
            offs=offs,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        out.append(
            case(
                f"fwd {tag} x e4m3 {label} {m}x{n}x{k}",
                fn,
                lambda bq=bq, bs=bs: ref(xq, xs, bq, bs),
                2 * m * n * k,
            )
        )
    return out


def wgrad_cases(m: int, n: int, k: int, sizes: list[int], a_dtype) -> list[dict]:
    """dW[e] = dy[e]^T x[e]: dy [m, n], x [m, k], ragged along m (the GEMM's K)."""
    g = len(sizes)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dyt = dy.t().contiguous()  # [n, m]
    # one scale per (expert segment, row of dyt) / (expert segment, column of x)
    segs_dy = torch.stack(
        [dyt[:, s].abs().amax(1) for s in torch.split(torch.arange(m, device="cuda"), sizes)]
    )
    segs_x = torch.stack(
        [x[s].abs().amax(0) for s in torch.split(torch.arange(m, device="cuda"), sizes)]
    )
    sa = segs_dy.float().clamp(min=1e-12) / torch.finfo(a_dtype).max  # [g, n]
    sb = segs_x.float().clamp(min=1e-12) / 448  # [g, k]
    seg = torch.repeat_interleave(
        torch.arange(g, device="cuda"), torch.tensor(sizes, device="cuda")
    )
    aq = (dyt.float() / sa[seg].t()).to(a_dtype)  # [n, m]
    bq = (x.float() / sb[seg]).to(E4M3)  # [m, k]
    bq_cm = bq.t().contiguous().t()  # column-major

    def ref():
        outs, start = [], 0
        for e, size in enumerate(sizes):
            a = aq[:, start : start + size].double() * sa[e].double()[:, None]
            b = bq[start : start + size].double() * sb[e].double()[None, :]
            outs.append(a @ b)
            start += size
        return torch.stack(outs)

    tag = "e5m2" if a_dtype == E5M2 else "e4m3"
    rows = []
    for out_dtype in (torch.float32, torch.bfloat16):
        fn = lambda out_dtype=out_dtype: torch._scaled_grouped_mm(  # noqa: E731
            aq, bq_cm, sa.reshape(-1), sb.reshape(-1), offs=offs, out_dtype=out_dtype,
            use_fast_accum=True,
        )  # fmt: skip
        name = f"wgrad {tag} x e4m3 2d-2d {n}x{k} K={m} out {str(out_dtype)[6:]}"
        rows.append(case(name, fn, ref, 2 * m * n * k))
    # The swapped product dW^T[e] = x[e]^T dy[e]: E4M3 as mat_a, the gradient as mat_b,
    # transposed back for the check. An E5M2 gradient (the hybrid format) is refused there too
    # (torch's meta check asks E4M3 of both operands); the row records what this torch says.
    xt = bq.t().contiguous()  # [k, m]
    dy_cm = aq.t()  # [m, n], column-major (aq is [n, m] row-major)
    swapped = lambda: torch._scaled_grouped_mm(  # noqa: E731
        xt, dy_cm, sb.reshape(-1), sa.reshape(-1), offs=offs, out_dtype=torch.bfloat16,
        use_fast_accum=True,
    ).transpose(1, 2)  # fmt: skip
    name = f"wgrad swapped e4m3 x {tag} 2d-2d {k}x{n} K={m} out bfloat16"
    return rows + [case(name, swapped, ref, 2 * m * n * k)]


def main() -> None:
    torch.manual_seed(0)
    ffn = int(sys.argv[sys.argv.index("--ffn") + 1]) if "--ffn" in sys.argv else 1408
    g, tokens, topk, hidden = 64, 8192, 8, 2048  # --ffn 768: model M's experts
    m = tokens * topk
    weights = torch.rand(g, generator=torch.Generator().manual_seed(1)) + 0.5
    sizes = (weights / weights.sum() * m).floor().long()
    sizes[-1] += m - sizes.sum()
    sizes = [int(s) // 16 * 16 for s in sizes]
    sizes[-1] += m - sum(sizes)
    print(json.dumps(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())))
    rows = []
    for a_dtype in (E4M3, E5M2):
        rows += forward_cases(m, 2 * ffn, hidden, sizes, a_dtype)
        rows += forward_cases(m, hidden, ffn, sizes, a_dtype)
        rows += wgrad_cases(m, hidden, ffn, sizes, a_dtype)
    for row in rows:
        print(json.dumps(row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
