#!/usr/bin/env python3
"""Compile the FP8 quantization kernels for sm_90 on a machine without a GPU and report, per
kernel, registers per thread, SASS instructions per element and memory instructions.

The kernels are bound by instruction issue as much as by DRAM (each instruction per element
costs bandwidth), so the count per element is a cheap first check of a kernel change before
any GPU time is spent; ncu (dev/profile_quantize_kernels.py) and bench_fp8.py on the
H200 have the last word. Needs Triton (its wheel ships ptxas and cuobjdump), not CUDA:

    pip download triton==3.6.0 --no-deps -d /tmp/w
    pip install --target /tmp/tritonpkg /tmp/w/triton-*.whl
    PYTHONPATH=/tmp/tritonpkg:. python3 dev/aot_kernels.py [--shape 8192x4096] [names...]

Launch configurations and constexprs come from quantize.py's spec helpers (TILE_CONFIG), so
what is compiled is what Fp8Linear launches. "per elem" divides the static instruction count
by the elements one thread handles per program: exact for kernels without a runtime loop, an
undercount for the casts and the rows kernel when their GROUP > 1 (the loop body runs GROUP
times), so compare those only at equal GROUP. Pointer arguments and ints divisible by 16 get
Triton's divisibility-16 hint, as at run time for aligned tensors.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("aot_kernels.py needs Triton: pip install --target DIR triton==3.6.0 (no GPU needed)")

import torch

from megatron.core.fp8.cuda import quantize_blockwise as qbw
from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda import quantize_mxfp8 as qmx
from megatron.core.fp8.cuda import quantize_per_tensor as qpt
from megatron.core.fp8.debug import DEBUG, set_debug_config

_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
_OP = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_.]+)?)")


def compile_sm90(kernel, args: tuple, constexprs: dict):
    """The CompiledKernel of kernel(*args, **constexprs) for sm_90, compiled here."""
    signature, attrs, constants, options = {}, {}, {}, {}
    for index, value in enumerate(args):
        name = kernel.arg_names[index]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        if name in _OPTIONS:
            options[name] = value
        else:
            signature[name], constants[name] = "constexpr", value
    for param in kernel.params:  # constexprs left at their defaults
        if param.name not in signature:
            signature[param.name], constants[param.name] = "constexpr", param.default
    source = ASTSource(
        fn=kernel,
        signature={n: signature[n] for n in kernel.arg_names},
        constexprs=constants,
        attrs=attrs,
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass_report(compiled) -> tuple[int, collections.Counter]:
    """(registers per thread, SASS opcode counts) of a compiled kernel."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = [os.path.join(tools, "cuobjdump"), cubin.name]
        usage = subprocess.run(
            dump[:1] + ["-res-usage"] + dump[1:], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            dump[:1] + ["-sass"] + dump[1:], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), collections.Counter(_OP.findall(sass))


def cases(rows: int, cols: int) -> dict[str, tuple]:
    """name -> (kernel, args, constexprs, elements per program) for the shipped kernels."""
    bf16 = torch.empty(rows, cols, dtype=torch.bfloat16)
    u8 = torch.empty(rows, cols, dtype=torch.uint8)
    f32 = torch.empty(64, dtype=torch.float32)
    e4m3 = torch.float8_e4m3fn
    block = dict(fp8_dtype=e4m3, power_2_scale=True, input_dtype=torch.bfloat16)
    out = {}
    kernel, grid, constexprs, per_program = qpt.amax_partials_spec(rows * cols)
    out["amax"] = (kernel, (bf16, f32, rows * cols, per_program), constexprs, grid)
    for write_t in (False, True):
        for recipe in ("tensorwise", "delayed"):
            kernel, grid, constexprs = qpt.per_tensor_cast_spec(
                rows,
                cols,
                write_row=True,
                write_t=write_t,
                record=recipe == "delayed",
                fp8_dtype=e4m3,
                recipe=recipe,
                power_2_scale=False,
                input_dtype=torch.bfloat16,
                amax_partials=256 if recipe == "tensorwise" else 0,
            )
            name = f"{recipe} cast{' + T' if write_t else ''}"
            out[name] = (kernel, (bf16, u8, u8, f32, f32, f32, f32, rows, cols), constexprs, grid)
    kernel, grid, constexprs = qbw.block_1x128_rows_spec(
        rows, cols, record=False, row_scale_t=True, **block
    )
    out["1x128 rows"] = (kernel, (bf16, u8, f32, f32, rows, cols), constexprs, grid)
    kernel, grid, constexprs = qbw.block_128x1_cols_spec(
        rows, cols, columnwise=False, write_t=True, record=False, **block
    )
    out["128x1 cols T"] = (kernel, (bf16, u8, f32, u8, f32, rows, cols), constexprs, grid)
    fused_spec = getattr(qbw, "block_1x128_fused_spec", None)  # absent before cc97b24
    pair = qc.tile_config("block_1x128_pair")
    # The one-launch 1x128 pair: the paired kernel where configured, and the fused kernel.
    for name, pair_config in (("1x128 pair row + T", pair), ("1x128 fused row + T", {})):
        if fused_spec is None or (name.startswith("1x128 pair") and not pair_config):
            continue
        previous = set_debug_config(tiles={**DEBUG.tiles, "block_1x128_pair": pair_config})
        try:
            spec = fused_spec(
                rows, cols, columnwise=False, write_t=True, record=False, row_scale_t=True, **block
            )
        finally:
            set_debug_config(**previous)
        if spec is not None:
            out[name] = (spec[0], (bf16, u8, f32, u8, f32, u8, f32, rows, cols), spec[2], spec[1])
    kernel, grid, constexprs = qbw.block_128x128_spec(
        rows, cols, write_row=True, write_t=True, record=False, **block
    )
    out["128x128 row + T"] = (kernel, (bf16, u8, f32, u8, f32, f32, rows, cols), constexprs, grid)
    for dequant in (False, True):
        kernel, grid, constexprs = qmx.mxfp8_spec(
            rows,
            cols,
            rowwise=True,
            columnwise=True,
            write_t=False,
            record=False,
            fp8_dtype=e4m3,
            dequant=dequant,
        )
        values = bf16 if dequant else u8
        args = (bf16, values, u8, values, u8, u8, f32, rows, cols)
        out[f"mxfp8 row + col{' dequantized' if dequant else ''}"] = (
            kernel,
            args,
            constexprs,
            grid,
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x4096", help="ROWSxCOLS of the bf16 input")
    parser.add_argument("names", nargs="*", help="kernels to compile (default: all)")
    args = parser.parse_args(argv)
    try:
        rows, cols = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"--shape must look like 8192x4096, got {args.shape!r}")
    table = cases(rows, cols)
    unknown = [n for n in args.names if n not in table]
    if unknown:
        parser.error(f"unknown kernel(s) {unknown}; choose from {sorted(table)}")
    print(f"{'kernel':24} {'regs':>4} {'instr':>6} {'per elem':>8}  memory instructions")
    for name, (kernel, kernel_args, constexprs, grid) in table.items():
        if args.names and name not in args.names:
            continue
        registers, ops = sass_report(compile_sm90(kernel, kernel_args, constexprs))
        total = sum(ops.values())
        # The pair kernel's programs each run one of its two branches (a rows or a cols tile)
        # and every element is visited by one of each: count both copies per element.
        visits = 2 if name.startswith("1x128 pair") else 1
        per_thread = visits * rows * cols / grid[0] / (32 * constexprs.get("num_warps", 4))
        memory = {op: n for op, n in sorted(ops.items()) if op.startswith(("LD", "ST"))}
        print(f"{name:24} {registers:4d} {total:6d} {total / per_thread:8.2f}  {memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
