"""Investigation (issue 38): how fast can a Triton FP8 grouped GEMM be on this GPU, against torch's
bf16 `_grouped_mm` and FP8 `_scaled_grouped_mm` (fast and precise accumulation)?

Ragged-M (forward, dgrad) kernels over one schedule of (group, first row) tiles built on the
device once: pointer loads or TMA tensor descriptors, tile shapes and pipeline depths swept,
fast accumulation (one fp32 accumulator fed by the tensor cores) or precise (each K block's
product added to a separate fp32 accumulator, as cuBLAS does without fast accumulation).
Ragged-K (weight gradient) kernels with group starts aligned to 128 tokens or not. Per-tensor
scales (a scalar for A, one per group for B). One JSON line per case: TFLOP/s, and for the best
case of each family the largest error against a float64 product relative to its largest value.

    python3 dev/tune_grouped_gemm.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.language as tl

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@triton.jit
def ragged_m_ptr(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale,
    b_scale_ptr,
    tile_group_ptr,
    tile_row_ptr,
    group_end_ptr,
    N,
    K,
    stride_am,
    stride_bg,
    stride_bn,
    stride_cm,
    FAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.load(tile_group_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(group_end_ptr + group)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = b_ptr + group.to(tl.int64) * stride_bg + cols[:, None] * stride_bn + ks[None, :]
    row_ok = rows < row_end
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs)  # K % BLOCK_K == 0 here; rows past the group are other rows
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(a_scale) * tl.load(b_scale_ptr + group)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def ragged_m_tma(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale,
    b_scale_ptr,
    tile_group_ptr,
    tile_row_ptr,
    group_end_ptr,
    M,
    N,
    K,
    G,
    stride_cm,
    FAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.load(tile_group_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(group_end_ptr + group)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [G * N, K], [K, 1], [BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n0 = group * N + pid_n * BLOCK_N
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        b = b_desc.load([n0, k0])
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
    acc = acc * tl.load(a_scale) * tl.load(b_scale_ptr + group)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :]
    )


@triton.jit
def ragged_k_ptr(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale,
    b_scale,
    group_start_ptr,
    N,
    K,
    stride_an,
    stride_bk,
    stride_cg,
    stride_cn,
    FAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    group = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(group_start_ptr + group)
    end = tl.load(group_start_ptr + group + 1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        m_ok = (m0 + ms) < end
        a = tl.load(
            a_ptr + ns[:, None].to(tl.int64) * stride_an + (m0 + ms)[None, :],
            mask=m_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None].to(tl.int64) * stride_bk + (m0 + ms)[None, :],
            mask=m_ok[None, :],
            other=0.0,
        )
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
    acc = acc * tl.load(a_scale) * tl.load(b_scale)
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + ns[:, None] * stride_cn + kk[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (kk < K)[None, :])


@triton.jit
def ragged_k_tma(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale,
    b_scale,
    group_start_ptr,
    N,
    K,
    M,
    stride_cg,
    stride_cn,
    FAST: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    group = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(group_start_ptr + group)
    end = tl.load(group_start_ptr + group + 1)
    a_desc = tl.make_tensor_descriptor(a_ptr, [N, M], [M, 1], [BLOCK_N, BLOCK_M])
    b_desc = tl.make_tensor_descriptor(b_ptr, [K, M], [M, 1], [BLOCK_K, BLOCK_M])
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        a = a_desc.load([pid_n * BLOCK_N, m0])
        b = b_desc.load([pid_k * BLOCK_K, m0])
        if MASK:
            b = tl.where(((m0 + ms) < end)[None, :], b, tl.zeros_like(b))
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc += tl.dot(a, tl.trans(b))
    acc = acc * tl.load(a_scale) * tl.load(b_scale)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + ns[:, None] * stride_cn + kk[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (kk < K)[None, :])


def launch(kernel, grid, args, meta):
    return kernel[grid](*args, **meta)


def group_sizes(m: int, g: int, align: int, seed: int = 1) -> list[int]:
    weights = torch.rand(g, generator=torch.Generator().manual_seed(seed)) + 0.5
    sizes = [int(s) // align * align for s in (weights / weights.sum() * m).tolist()]
    sizes[-1] += m - sum(sizes)
    return sizes


def schedule(sizes: list[int], block_m: int, device) -> tuple:
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    tiles = [(g, r) for g in range(len(sizes)) for r in range(offsets[g], offsets[g + 1], block_m)]
    sched = torch.tensor(tiles, dtype=torch.int32, device=device).t().contiguous()
    ends = torch.tensor(offsets[1:], dtype=torch.int32, device=device)
    starts = torch.tensor(offsets, dtype=torch.int32, device=device)
    return sched, ends, starts, offsets


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def ragged_m_cases(name, a, b, sizes, quick) -> list[dict]:
    """a [M, K] fp8, b [G, N, K] fp8 (per-tensor scales 1)."""
    m, k = a.shape
    g, n, _ = b.shape
    flops = 2 * m * n * k
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    one = torch.ones((), device=a.device)
    ones = torch.ones(g, device=a.device)
    rows = []
    blocks_m = (128,) if quick else (64, 128)
    shapes = itertools.product(
        ("ptr", "tma"), (True, False), blocks_m, (128, 256), (64, 128), (4, 8), (3, 4)
    )
    best = {}
    for kind, fast, bm, bn, bk, warps, stages in shapes:
        if quick and (warps, stages) not in ((8, 3), (8, 4)):
            continue
        sched, ends, _, _ = schedule(sizes, bm, a.device)
        grid = (sched.shape[1], triton.cdiv(n, bn))
        common = dict(
            FAST=fast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages
        )
        args = (a, b, out, one, ones, sched[0], sched[1], ends)
        if kind == "ptr":
            args += (n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0))
        else:
            args += (m, n, k, g, out.stride(0))
        kernel = ragged_m_ptr if kind == "ptr" else ragged_m_tma
        run = functools.partial(launch, kernel, grid, args, common)
        label = dict(
            gemm=name, kind=kind, fast=fast, block=(bm, bn, bk), warps=warps, stages=stages
        )
        try:
            ms = bench(run)
        except Exception as err:  # noqa: BLE001 - a config the compiler refuses is a finding
            rows.append(dict(label, error=f"{type(err).__name__}: {str(err)[:160]}"))
            continue
        row = dict(label, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        rows.append(row)
        key = (kind, fast)
        if key not in best or row["tflops"] > best[key][0]["tflops"]:
            best[key] = (row, run)
    want = reference_ragged_m(a, b, sizes)
    for (kind, fast), (row, run) in best.items():
        run()
        rows.append(
            dict(
                gemm=name,
                best=f"{kind} fast={fast}",
                tflops=row["tflops"],
                block=row["block"],
                warps=row["warps"],
                stages=row["stages"],
                rel_error=rel_error(out, want),
            )
        )
    return rows


def reference_ragged_m(a, b, sizes) -> torch.Tensor:
    outs, start = [], 0
    for e, s in enumerate(sizes):
        outs.append(a[start : start + s].double() @ b[e].double().t())
        start += s
    return torch.cat(outs)


def torch_rows(name, a, b, sizes, x_bf16, w_bf16) -> list[dict]:
    m, k = a.shape
    g, n, _ = b.shape
    flops = 2 * m * n * k
    offs = torch.tensor(sizes, device=a.device).cumsum(0).to(torch.int32)
    rows = [
        dict(
            gemm=name,
            kind="torch bf16 _grouped_mm",
            tflops=round(
                flops
                / bench(lambda: torch._grouped_mm(x_bf16, w_bf16.transpose(1, 2), offs=offs))
                / 1e9,
                1,
            ),
        )
    ]
    if a.dtype != E4M3:
        return rows
    sa = torch.ones(m, device=a.device)
    sb = torch.ones(g, n, device=a.device)
    want = reference_ragged_m(a, b, sizes)
    for fast in (True, False):
        fn = functools.partial(
            torch._scaled_grouped_mm,
            a,
            b.transpose(1, 2),
            sa,
            sb,
            offs=offs,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )
        rows.append(
            dict(
                gemm=name,
                kind=f"torch _scaled_grouped_mm fast={fast}",
                tflops=round(flops / bench(fn) / 1e9, 1),
                rel_error=rel_error(fn(), want),
            )
        )
    return rows


def ragged_k_cases(a_t, b_t, sizes, label, quick) -> list[dict]:
    """a_t [N, M], b_t [K, M] fp8 -> [G, N, K]."""
    n, m = a_t.shape
    k = b_t.shape[0]
    g = len(sizes)
    flops = 2 * m * n * k
    out = torch.empty(g, n, k, dtype=torch.float32, device=a_t.device)
    one = torch.ones((), device=a_t.device)
    _, _, starts, offsets = schedule(sizes, 128, a_t.device)
    rows, best = [], {}
    out32, out16 = out, out.to(torch.bfloat16)
    variants = ("ptr", "tma_mask_fp32", "tma_mask_bf16", "tma_nomask_bf16")
    for variant, fast, bn, bk, bm, warps, stages in itertools.product(
        variants, (True, False), (128, 256), (64, 128), (64, 128), (4, 8), (3, 4)
    ):
        if quick and ((warps, stages) not in ((8, 3), (8, 4)) or bk != 128):
            continue
        if variant == "tma_nomask_bf16" and any(size % bm for size in sizes):
            continue
        out = out32
        grid = (g, triton.cdiv(n, bn), triton.cdiv(k, bk))
        args = (a_t, b_t, out, one, one, starts, n, k, a_t.stride(0), b_t.stride(0))
        args += (out.stride(0), out.stride(1))
        meta = dict(FAST=fast, BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=bm)
        if variant != "ptr":
            out = out32 if variant.endswith("fp32") else out16
            args = (a_t, b_t, out, one, one, starts, n, k, m, out.stride(0), out.stride(1))
            meta["MASK"] = variant.startswith("tma_mask")
        run = functools.partial(
            launch,
            ragged_k_ptr if variant == "ptr" else ragged_k_tma,
            grid,
            args,
            meta | dict(num_warps=warps, num_stages=stages),
        )
        try:
            ms = bench(run)
        except Exception as err:  # noqa: BLE001
            rows.append(
                dict(
                    gemm=f"wgrad {label}",
                    v=variant,
                    fast=fast,
                    block=(bn, bk, bm),
                    error=str(err)[:160],
                )
            )
            continue
        row = dict(
            gemm=f"wgrad {label}",
            fast=fast,
            block=(bn, bk, bm),
            warps=warps,
            stages=stages,
            ms=round(ms, 4),
            tflops=round(flops / ms / 1e9, 1),
        )
        rows.append(row)
        row["v"] = variant
        if (variant, fast) not in best or row["tflops"] > best[variant, fast][0]["tflops"]:
            best[variant, fast] = (row, run, out)
    want = torch.stack(
        [
            a_t[:, offsets[e] : offsets[e + 1]].double()
            @ b_t[:, offsets[e] : offsets[e + 1]].double().t()
            for e in range(g)
        ]
    )
    for (variant, fast), (row, run, result) in best.items():
        run()
        rows.append(
            dict(
                gemm=f"wgrad {label}",
                best=f"{variant} fast={fast}",
                tflops=row["tflops"],
                block=row["block"],
                warps=row["warps"],
                stages=row["stages"],
                rel_error=rel_error(result, want),
            )
        )
    if a_t.dtype == E4M3:
        offs = torch.tensor(sizes, device=a_t.device).cumsum(0).to(torch.int32)
        b_cm = b_t.t()  # [M, K] column-major view
        for fast in (True, False):
            fn = functools.partial(
                torch._scaled_grouped_mm,
                a_t,
                b_cm,
                torch.ones(g * n, device=a_t.device),
                torch.ones(g * k, device=a_t.device),
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            )
            try:
                rows.append(
                    dict(
                        gemm=f"wgrad {label}",
                        kind=f"torch _scaled_grouped_mm 2d-2d fast={fast}",
                        tflops=round(flops / bench(fn) / 1e9, 1),
                        rel_error=rel_error(fn(), want),
                    )
                )
            except Exception as err:  # noqa: BLE001
                rows.append(dict(gemm=f"wgrad {label}", kind="torch 2d-2d", error=str(err)[:200]))
    return rows


def fp8(shape, dtype, std=1.0):
    return (torch.randn(*shape, device="cuda") * std).clamp(-200, 200).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("ragged_m", "wgrad"), default=None)
    parser.add_argument("--ffn", type=int, default=1408, help="expert ffn (model M: 768)")
    args = parser.parse_args()
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    torch.manual_seed(0)
    g, m, hidden, ffn = 64, 65536, 2048, args.ffn
    sizes = group_sizes(m, g, 1)
    for name, n, k, a_dtype in (
        ()
        if args.only == "wgrad"
        else (
            ("fc1 fwd", 2 * ffn, hidden, E4M3),
            ("fc2 fwd", hidden, ffn, E4M3),
            ("fc1 dgrad e5m2", hidden, 2 * ffn, E5M2),
        )
    ):
        a, b = fp8((m + 256, k), a_dtype), fp8((g, n, k), E4M3)
        a = a[:m]  # rows past M exist: the pointer kernel reads whole tiles unmasked
        x_bf16, w_bf16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        for row in torch_rows(name, a, b, sizes, x_bf16, w_bf16) + ragged_m_cases(
            name, a, b, sizes, args.quick
        ):
            print(json.dumps(row), flush=True)
    for align, a_dtype in ((16, E4M3), (128, E5M2)) if args.only != "ragged_m" else ():
        # torch's 2d-2d grouped GEMMs assert on group starts that are not multiples of 16
        s = group_sizes(m, g, align)
        a_t, b_t = fp8((hidden, m), a_dtype), fp8((ffn, m), E4M3)
        bf_a, bf_b = a_t.to(torch.bfloat16), b_t.to(torch.bfloat16)
        offs = torch.tensor(s, device="cuda").cumsum(0).to(torch.int32)
        label = f"align={align} a={str(a_dtype)[-6:]}"
        for row in ragged_k_cases(a_t, b_t, s, label, args.quick):
            print(json.dumps(row), flush=True)
        ms = bench(functools.partial(torch._grouped_mm, bf_a, bf_b.t(), offs=offs))
        print(
            json.dumps(
                dict(
                    gemm=f"wgrad align={align}",
                    kind="torch bf16 _grouped_mm",
                    tflops=round(2 * m * hidden * ffn / ms / 1e9, 1),
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
