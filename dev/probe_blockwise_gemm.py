#!/usr/bin/env python3
"""GPU probe: can a Triton blockwise FP8 GEMM beat cuBLAS's (torch._scaled_mm) on this GPU?

Blockwise Fp8Linear at M=8192, K=N=4096 spends about 87% of its step in cuBLAS's three
blockwise GEMMs, so those decide whether the recipe reaches its speed target. This script
times three Triton formulations of C = sum over 128-K blocks of (A_kb B_kb^T) * sa * sb
against torch._scaled_mm for the Linear's fprop, dgrad and wgrad, and compares the outputs
bitwise:

- `loop`: pointer loads pipelined by Triton (cp.async); each block's wgmma result is rescaled
  into the fp32 accumulator before the next block starts.
- `pipelined`: TMA loads; the loop is software-pipelined by hand, so block kb's wgmma is
  issued before block kb-1's partial product is rescaled (the tensor cores can work during
  the rescale).
- `specialized`: TMA loads of the operands and of both scale vectors, in a loop Triton splits
  into producer and consumer warps (`warp_specialize=True`). Only for wgrad, whose two
  operands both carry 1x128 scales (a 128x128 block's single scale is narrower than TMA's
  16-byte minimum).

Every kernel applies the same per-block promotion in the same order as cuBLAS, so the
outputs are expected to be bitwise equal. Results go to stdout and, as JSON lines, to
$OUT/probe_blockwise_gemm.jsonl. Run: python3 dev/probe_blockwise_gemm.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(  # bench_fp8's timers
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    sys.exit("probe_blockwise_gemm.py needs Triton and a CUDA GPU (it times GPU kernels)")
from bench_fp8 import kernel_ms
from probe_cublaslt_blockwise import linear_gemm_operands

from megatron.core.fp8.cuda import linear_ops
from megatron.core.fp8.quantized_tensor import Fp8Operand

BLOCK_K = 128  # the recipe's scaling block along K

# (BM, BN, stages, warps, register cap or None) per kernel: each kernel's fastest configurations
# in earlier probes. The last two warp-specialized ones do not compile with Triton 3.6 (its
# NVGPUWarpSpecialization pass fails); they stay so that the probe shows it.
CONFIGS = {
    "loop": [
        (64, 128, 3, 4, 168),
        (64, 128, 3, 4, None),
        (64, 128, 4, 4, None),
        (128, 128, 3, 8, None),
        (128, 64, 3, 4, None),
        (64, 64, 4, 4, None),
    ],
    "pipelined": [
        (128, 64, 3, 4, None),
        (64, 128, 4, 4, None),
        (128, 128, 3, 8, None),
        (64, 64, 4, 4, None),
    ],
    "specialized": [
        (128, 128, 3, 8, None),
        (64, 128, 4, 4, None),
        (128, 128, 4, 4, None),
        (128, 64, 4, 4, None),
    ],
}


@triton.jit
def _tile_coords(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in grouped order: GROUP_M row tiles share each column tile's B reads."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    width = GROUP_M * tl.cdiv(N, BN)
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _block_scales(sa_ptr, sb_ptr, offs_m, offs_n, kb, M, N, k_blocks, B_2D: tl.constexpr):
    """sa[m, kb] * sb[n, kb] as a [BM, BN] tile. 1x128 scales are stored K-block-major
    ([k_blocks, rows]); a 128x128-block operand's are [N/128, k_blocks]."""
    sa = tl.load(sa_ptr + kb * M + offs_m)
    if B_2D:
        sb = tl.load(sb_ptr + (offs_n // 128) * k_blocks + kb)
    else:
        sb = tl.load(sb_ptr + kb * N + offs_n)
    return sa[:, None] * sb[None, :]


@triton.jit
def loop_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    M,
    N,
    K,
    k_blocks,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_2D: tl.constexpr,
    STAGES: tl.constexpr,
):
    # STAGES is unused: this loop takes the launch's num_stages, as in the fastest earlier run.
    pid_m, pid_n = _tile_coords(M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    sa_ptrs = sa_ptr + offs_m
    if B_2D:
        sb_ptrs = sb_ptr + (offs_n // 128) * k_blocks
    else:
        sb_ptrs = sb_ptr + offs_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(k_blocks):
        part = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)))
        acc += part * (tl.load(sa_ptrs)[:, None] * tl.load(sb_ptrs)[None, :])
        a_ptrs += BK
        b_ptrs += BK
        sa_ptrs += M  # next K block's scales (K-block-major layout, see _block_scales)
        if B_2D:
            sb_ptrs += 1
        else:
            sb_ptrs += N
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))


@triton.jit
def pipelined_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    M,
    N,
    K,
    k_blocks,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_2D: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(M, N, BM, BN, GROUP_M)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    prev = tl.dot(a_desc.load([pid_m * BM, 0]), tl.trans(b_desc.load([pid_n * BN, 0])))
    prev_scales = _block_scales(sa_ptr, sb_ptr, offs_m, offs_n, 0, M, N, k_blocks, B_2D)
    for kb in tl.range(1, k_blocks, num_stages=STAGES):
        a = a_desc.load([pid_m * BM, kb * BK])
        part = tl.dot(a, tl.trans(b_desc.load([pid_n * BN, kb * BK])))
        acc += prev * prev_scales
        prev_scales = _block_scales(sa_ptr, sb_ptr, offs_m, offs_n, kb, M, N, k_blocks, B_2D)
        prev = part
    acc += prev * prev_scales
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))


@triton.jit
def specialized_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    c_ptr,
    M,
    N,
    K,
    k_blocks,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_2D: tl.constexpr,
    STAGES: tl.constexpr,
):
    # B_2D is unused: only 1x128 x 1x128 (wgrad) runs here, see the module docstring.
    pid_m, pid_n = _tile_coords(M, N, BM, BN, GROUP_M)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    sa_desc = tl.make_tensor_descriptor(
        sa_ptr, shape=[k_blocks, M], strides=[M, 1], block_shape=[1, BM]
    )
    sb_desc = tl.make_tensor_descriptor(
        sb_ptr, shape=[k_blocks, N], strides=[N, 1], block_shape=[1, BN]
    )
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(k_blocks, num_stages=STAGES, warp_specialize=True):
        a = a_desc.load([pid_m * BM, kb * BK])
        part = tl.dot(a, tl.trans(b_desc.load([pid_n * BN, kb * BK])))
        sa = sa_desc.load([kb, pid_m * BM]).reshape(BM)
        sb = sb_desc.load([kb, pid_n * BN]).reshape(BN)
        acc += part * (sa[:, None] * sb[None, :])
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))


KERNELS = {"loop": loop_kernel, "pipelined": pipelined_kernel, "specialized": specialized_kernel}


def _check_scale_layout(operand: Fp8Operand, *, two_d: bool) -> None:
    """The kernels index scales as described in _block_scales; refuse any other layout."""
    rows, k = operand.data.shape
    scales = operand.scale_inv
    if two_d:
        want_shape, want_stride = (rows // 128, k // BLOCK_K), (k // BLOCK_K, 1)
    else:
        want_shape, want_stride = (rows, k // BLOCK_K), (1, rows)
    if tuple(scales.shape) != want_shape or scales.stride() != want_stride:
        raise SystemExit(
            f"unexpected scale layout {tuple(scales.shape)} stride {scales.stride()}"
            f" (kernels expect {want_shape} stride {want_stride})"
        )


def _time_kernel(name: str, config: tuple, a, b, two_d: bool, reference: torch.Tensor) -> dict:
    block_m, block_n, stages, warps, max_registers = config
    rows, k = a.data.shape
    cols = b.data.shape[0]
    out = torch.zeros(rows, cols, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n),)
    options = {} if max_registers is None else {"maxnreg": max_registers}

    def launch():
        KERNELS[name][grid](
            a.data,
            b.data,
            a.scale_inv,
            b.scale_inv,
            out,
            rows,
            cols,
            k,
            k // BLOCK_K,
            BM=block_m,
            BN=block_n,
            BK=BLOCK_K,
            GROUP_M=8,
            B_2D=two_d,
            STAGES=stages,
            num_stages=stages,
            num_warps=warps,
            **options,
        )

    row = {
        "kernel": name,
        "BM": block_m,
        "BN": block_n,
        "stages": stages,
        "warps": warps,
        "maxnreg": max_registers,
    }
    try:
        launch()
        torch.cuda.synchronize()
    except Exception as error:  # a config Triton cannot compile is a result, not a crash
        return {**row, "error": f"{type(error).__name__}: {str(error).splitlines()[-1][:160]}"}
    row["bitwise_equal"] = bool(torch.equal(out, reference))
    row["us"] = round(kernel_ms(launch) * 1e3, 1)
    return row


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("probe_blockwise_gemm.py needs a CUDA GPU (it times compiled GPU kernels)")
    m, k, n = 8192, 4096, 4096
    # TMA descriptors built on the device need a global scratch allocation from Triton.
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    out_dir = os.environ.get("OUT")
    sink = Path(out_dir) / "probe_blockwise_gemm.jsonl" if out_dir else None
    print(
        f"torch {torch.__version__}, Triton {triton.__version__}, "
        f"{torch.cuda.get_device_name()}; M={m} K={k} N={n}"
    )
    rows = []
    for gemm_name, (a, b) in linear_gemm_operands("blockwise", m=m, k=k, n=n).items():
        two_d = gemm_name != "wgrad"  # fprop and dgrad read the 128x128-scaled weight
        _check_scale_layout(a, two_d=False)
        _check_scale_layout(b, two_d=two_d)

        def cublas(a=a, b=b):
            return linear_ops.gemm(
                a, b, recipe="blockwise", out_dtype=torch.bfloat16, fast_accum=False
            )

        reference = cublas()
        cublas_us = kernel_ms(cublas) * 1e3
        flop = 2 * a.data.shape[0] * b.data.shape[0] * a.data.shape[1]
        tflops = flop / cublas_us / 1e6
        print(f"{gemm_name}: torch._scaled_mm {cublas_us:.1f} us ({tflops:.0f} TFLOPS)")
        for name, configs in CONFIGS.items():
            if name == "specialized" and two_d:
                continue
            for config in configs:
                row = {
                    "gemm": gemm_name,
                    "cublas_us": round(cublas_us, 1),
                    **_time_kernel(name, config, a, b, two_d, reference),
                }
                rows.append(row)
                if "error" in row:
                    print(f"  {name} {config}: {row['error']}")
                else:
                    tflops, ratio = flop / row["us"] / 1e6, cublas_us / row["us"]
                    print(
                        f"  {name} {config}: {row['us']:.1f} us ({tflops:.0f} TFLOPS, "
                        f"{ratio:.3f}x cuBLAS), bitwise equal: "
                        f"{row['bitwise_equal']}"
                    )
    if sink is not None:
        sink.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    timed = [row for row in rows if "us" in row]
    best = {
        g: min((r for r in timed if r["gemm"] == g), key=lambda r: r["us"], default=None)
        for g in ("fprop", "dgrad", "wgrad")
    }
    for gemm_name, row in best.items():
        if row is not None:
            print(
                f"best {gemm_name}: {row['kernel']} {row['BM']}x{row['BN']} {row['us']} us, "
                f"{row['cublas_us'] / row['us']:.3f}x cuBLAS"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
