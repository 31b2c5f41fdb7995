#!/usr/bin/env python3
"""GPU probe: does cuBLASLt have a faster algorithm than the one torch._scaled_mm picks?

torch._scaled_mm asks cuBLASLt's heuristic for one algorithm and runs it. This script calls
cuBLASLt itself (through ctypes, on the libcublasLt torch has loaded), asks for every
algorithm the heuristic offers for each of Fp8Linear's three GEMMs at M=8192, K=N=4096, and
times each one (CUDA graph replay) against torch._scaled_mm, checking its output bitwise.
Then it measures the host cost of one call both ways.

Run: python3 dev/probe_cublaslt_blockwise.py [blockwise] [tensorwise]
(default: both recipes). JSON lines go to $OUT/probe_cublaslt_blockwise.jsonl.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(  # bench_fp8's timers
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)

import torch
from bench_fp8 import kernel_ms

from megatron.core.fp8.cuda import linear_ops

# Values of the cublasLt.h enums used here (CUDA 12.9 / 13.0 headers).
COMPUTE_32F, CUDA_R_32F = 68, 0
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 3, 4, 17, 18
DESC_FAST_ACCUM, DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 25, 31, 32
SCALE_SCALAR_32F, SCALE_VEC128_32F, SCALE_BLK128x128_32F = 0, 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
CUDA_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.bfloat16: 14}
WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on sm_90
MAX_ALGOS = 32

VoidP = ctypes.c_void_p


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt that torch itself loaded (found in /proc/self/maps after a matmul)."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    if not paths:
        sys.exit("libcublasLt is not loaded in this process; torch's CUDA build is needed")
    lib = ctypes.CDLL(paths[0])
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(VoidP)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(VoidP), ctypes.c_int, ctypes.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [VoidP, ctypes.c_int, VoidP, ctypes.c_size_t]
    lib.cublasLtMatrixLayoutCreate.argtypes = [
        ctypes.POINTER(VoidP),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int64,
    ]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(VoidP)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [
        VoidP,
        ctypes.c_int,
        VoidP,
        ctypes.c_size_t,
    ]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [VoidP] * 7 + [
        ctypes.c_int,
        ctypes.POINTER(HeuristicResult),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.cublasLtMatmul.argtypes = [VoidP] * 14 + [ctypes.c_size_t, VoidP]
    print(f"cuBLASLt: {paths[0]}")
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned cublasStatus {status}")


class LtMatmul:
    """C[rows_a, rows_b] = A B^T in bf16 through cuBLASLt, as torch._scaled_mm issues it:
    column-major C^T = B A^T, so cuBLAS's A operand is our b (transposed) and its B is our a."""

    def __init__(self, lib, handle, a, b, *, fast_accum: bool, workspace: torch.Tensor):
        self.lib, self.handle, self.workspace = lib, handle, workspace
        rows_a, k = a.data.shape
        rows_b = b.data.shape[0]
        self.out_shape = (rows_a, rows_b)
        self.desc = VoidP()
        _check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, CUDA_R_32F),
            "cublasLtMatmulDescCreate",
        )
        self._set(DESC_TRANSA, ctypes.c_int32(1))
        self._set(DESC_TRANSB, ctypes.c_int32(0))
        if fast_accum:
            self._set(DESC_FAST_ACCUM, ctypes.c_int8(1))
        self.modes = (self._scale_mode(b), self._scale_mode(a))
        self._set(DESC_A_SCALE_MODE, ctypes.c_int32(self.modes[0]))
        self._set(DESC_B_SCALE_MODE, ctypes.c_int32(self.modes[1]))
        # The heuristic may read the scale pointers when block scaling is on: set them first.
        self._set_scales(a, b)
        self.layout_a = self._layout(CUDA_TYPES[b.data.dtype], k, rows_b, k)
        self.layout_b = self._layout(CUDA_TYPES[a.data.dtype], k, rows_a, k)
        self.layout_c = self._layout(CUDA_TYPES[torch.bfloat16], rows_b, rows_a, rows_b)
        preference = VoidP()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "PreferenceCreate")
        limit = ctypes.c_uint64(workspace.numel())
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                preference,
                PREF_MAX_WORKSPACE_BYTES,
                ctypes.cast(ctypes.byref(limit), VoidP),
                ctypes.sizeof(limit),
            ),
            "PreferenceSetAttribute",
        )
        self.results = (HeuristicResult * MAX_ALGOS)()
        count = ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.desc,
                self.layout_a,
                self.layout_b,
                self.layout_c,
                self.layout_c,
                preference,
                MAX_ALGOS,
                self.results,
                ctypes.byref(count),
            ),
            "cublasLtMatmulAlgoGetHeuristic",
        )
        self.algo_count = count.value

    @staticmethod
    def _scale_mode(operand) -> int:
        scales = operand.scale_inv
        rows, k = operand.data.shape
        if scales.dim() == 0 or scales.numel() == 1:
            return SCALE_SCALAR_32F
        return SCALE_VEC128_32F if tuple(scales.shape) == (rows, k // 128) else SCALE_BLK128x128_32F

    def _set(self, attribute: int, value) -> None:
        _check(
            self.lib.cublasLtMatmulDescSetAttribute(
                self.desc, attribute, ctypes.cast(ctypes.byref(value), VoidP), ctypes.sizeof(value)
            ),
            f"MatmulDescSetAttribute({attribute})",
        )

    def _set_scales(self, a, b) -> None:
        self._set(DESC_A_SCALE_POINTER, VoidP(b.scale_inv.data_ptr()))
        self._set(DESC_B_SCALE_POINTER, VoidP(a.scale_inv.data_ptr()))

    def _layout(self, cuda_type: int, rows: int, cols: int, leading: int) -> VoidP:
        layout = VoidP()
        _check(
            self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), cuda_type, rows, cols, leading
            ),
            "MatrixLayoutCreate",
        )
        return layout

    def __call__(self, a, b, *, algo: int) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=torch.bfloat16, device="cuda")
        self._set_scales(a, b)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = VoidP(torch.cuda.current_stream().cuda_stream)
        _check(
            self.lib.cublasLtMatmul(
                self.handle,
                self.desc,
                ctypes.cast(ctypes.byref(one), VoidP),
                VoidP(b.data.data_ptr()),
                self.layout_a,
                VoidP(a.data.data_ptr()),
                self.layout_b,
                ctypes.cast(ctypes.byref(zero), VoidP),
                VoidP(out.data_ptr()),
                self.layout_c,
                VoidP(out.data_ptr()),
                self.layout_c,
                ctypes.cast(ctypes.byref(self.results[algo].algo), VoidP),
                VoidP(self.workspace.data_ptr()),
                self.workspace.numel(),
                stream,
            ),
            "cublasLtMatmul",
        )
        return out


def linear_gemm_operands(
    recipe: str, *, m: int = 8192, k: int = 4096, n: int = 4096
) -> dict[str, tuple]:
    """Fp8Linear's three GEMMs at M=m, K=k, N=n as {name: (A, B)} with C = A B^T, from random
    x, w and dy (seed 0) quantized as Fp8Linear quantizes them: fprop X W^T, dgrad dY W,
    wgrad dY^T X. Shared with probe_blockwise_gemm.py."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3

    def quantize(t, role, fp8_dtype):
        return linear_ops.quantize_operands(
            t,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role=role,
            rowwise=True,
            transposed=True,
            power_2_scale=recipe == "blockwise",
        )

    x_row, x_t = quantize(x, "input", e4m3)
    w_row, w_t = quantize(w, "weight", e4m3)
    dy_row, dy_t = quantize(dy, "grad", e5m2)
    return {"fprop": (x_row, w_row), "dgrad": (dy_row, w_t), "wgrad": (dy_t, x_t)}


def _host_us(fn, calls: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _probe_gemm(lib, handle, workspace, *, recipe: str, name: str, a, b, fast: bool) -> list:
    """Every heuristic algorithm of one GEMM, timed and compared bitwise with torch's output."""

    def torch_gemm():
        return linear_ops.gemm(a, b, recipe=recipe, out_dtype=torch.bfloat16, fast_accum=fast)

    reference = torch_gemm()
    torch_us = kernel_ms(torch_gemm) * 1e3
    lt = LtMatmul(lib, handle, a, b, fast_accum=fast, workspace=workspace)
    print(
        f"{recipe} {name}: torch._scaled_mm {torch_us:.1f} us; scale modes {lt.modes};"
        f" {lt.algo_count} algorithms"
    )
    rows = []
    for algo in range(lt.algo_count):
        row = {"recipe": recipe, "gemm": name, "algo": algo, "torch_us": round(torch_us, 1)}
        try:
            out = lt(a, b, algo=algo)
            torch.cuda.synchronize()
        except RuntimeError as error:
            rows.append({**row, "error": str(error)})
            print(f"  algo {algo}: {error}")
            continue
        row["bitwise_equal"] = bool(torch.equal(out, reference))
        row["us"] = round(kernel_ms(lambda algo=algo: lt(a, b, algo=algo)) * 1e3, 1)
        rows.append(row)
        print(
            f"  algo {algo}: {row['us']:.1f} us ({torch_us / row['us']:.3f}x torch),"
            f" bitwise equal: {row['bitwise_equal']}"
        )
    return rows


def _host_costs(lib, handle, workspace) -> dict:
    """Host microseconds to issue one call on a tiny GEMM (the GPU idles: only issuing counts)."""
    small = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    small_row, _ = linear_ops.quantize_operands(
        small,
        recipe="tensorwise",
        fp8_dtype=torch.float8_e4m3fn,
        role="input",
        rowwise=True,
        transposed=False,
        power_2_scale=False,
    )
    small_lt = LtMatmul(lib, handle, small_row, small_row, fast_accum=True, workspace=workspace)
    torch_us = _host_us(
        lambda: linear_ops.gemm(
            small_row, small_row, recipe="tensorwise", out_dtype=torch.bfloat16, fast_accum=True
        )
    )
    lt_us = _host_us(lambda: small_lt(small_row, small_row, algo=0))
    print(f"host per call: torch._scaled_mm {torch_us:.1f} us, ctypes cuBLASLt {lt_us:.1f} us")
    return {"host_us_torch": round(torch_us, 1), "host_us_ctypes": round(lt_us, 1)}


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("probe_cublaslt_blockwise.py needs a CUDA GPU (it calls cuBLASLt)")
    lib = _load_cublaslt()
    handle = VoidP()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for recipe in sys.argv[1:] or ["blockwise", "tensorwise"]:
        for name, (a, b) in linear_gemm_operands(recipe).items():
            # Fp8Linear's fast accumulation: tensorwise forward GEMM only (docs/FP8_NUMERICS.md).
            fast = recipe == "tensorwise" and name == "fprop"
            rows += _probe_gemm(
                lib, handle, workspace, recipe=recipe, name=name, a=a, b=b, fast=fast
            )
    rows.append(_host_costs(lib, handle, workspace))
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "probe_cublaslt_blockwise.jsonl"
        path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
