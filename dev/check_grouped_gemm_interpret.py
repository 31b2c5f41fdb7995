"""The CUDA branches of the grouped FP8 GEMMs run on the CPU in Triton's interpreter.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 dev/check_grouped_gemm_interpret.py

The interpreter mis-rounds FP8 casts and has no FP8 dot, so every FP8 tensor handed to a kernel
is replaced by an fp32 carrier of the same values (exact: FP8 values are exact in fp32 and in
tf32). The product code's CUDA gates are bypassed here only (`_kernel_runs`, and grouped_fp8's
`_cuda_mm` / `_cuda_wgrad` called directly); the kernels run with BLOCK_N fixed (no autotuning).
Each check compares with the emulated twin (the CPU path) up to fp32 summation order.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from unittest import mock

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from megatron.core.fp8.config import Fp8Config  # noqa: E402
from megatron.core.fp8.cuda import grouped_gemm as gg  # noqa: E402
from megatron.core.fp8.cuda import triton_grouped_gemm as tgg  # noqa: E402
from megatron.core.transformer.moe import grouped_fp8 as gf  # noqa: E402
from megatron.core.transformer.moe import grouped_operands as ops  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [0, 1, 127, 128, 129, 0, 5]


def _carrier(arg):
    if isinstance(arg, torch.Tensor) and arg.dtype in (E4M3, E5M2):
        return arg.to(torch.float32)
    if isinstance(arg, TensorDescriptor):  # the ragged-K kernel's MODE 2 (TMA) operands
        return TensorDescriptor(_carrier(arg.base), arg.shape, arg.strides, arg.block_shape)
    return arg


class _Fixed:
    """kernel[grid](...) with fp32 carriers for FP8 tensors and BLOCK_N fixed."""

    def __init__(self, kernel, block_n):
        self.kernel, self.block_n = kernel, block_n

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs["BLOCK_N"] = self.block_n
            if kwargs.get("MODE") == 2 or kwargs.get("TMA"):  # the autotuners' hooks' work
                tiles = tgg.RAGGED_K_TILES if "MODE" in kwargs else tgg.RAGGED_M_TILES
                names = dict(zip(tiles, args[:2]))
                tgg.set_descriptor_tiles({**names, **kwargs}, tiles)
            fn_grid = grid(kwargs) if callable(grid) else grid
            self.kernel.fn[fn_grid](*[_carrier(a) for a in args], **kwargs)

        return launch


def _patched(block_n) -> contextlib.ExitStack:
    """The kernels run on CPU tensors (the CUDA gate bypassed), with BLOCK_N fixed."""
    kernels = type(
        "K",
        (),
        {
            "_ragged_m_kernel": _Fixed(tgg._ragged_m_kernel, block_n),
            "_ragged_k_kernel": _Fixed(tgg._ragged_k_kernel, block_n),
            "_ragged_k_add_kernel": _Fixed(tgg._ragged_k_add_kernel, block_n),
            "_transpose_bytes_kernel": tgg._transpose_bytes_kernel,
        },
    )
    stack = contextlib.ExitStack()
    runs = lambda recipe, *tensors: not gg.recipe_spec(recipe).e8m0_scales  # noqa: E731
    stack.enter_context(mock.patch.object(gg, "_kernel_runs", runs))
    on_cpu = lambda *tensors: not any(t.is_meta for t in tensors)  # noqa: E731
    stack.enter_context(mock.patch.object(gg, "_triton_runs", on_cpu))
    stack.enter_context(mock.patch.object(gg, "_kernels", lambda: kernels))
    return stack


def _fp8(shape, dtype=E4M3, scale=1.0):
    return (torch.randn(shape) * scale).clamp(-400, 400).to(dtype)


def _close(got, want, what):
    err = (got.double() - want.double()).abs().max().item()
    ref = want.double().abs().max().item()
    ok = err <= 1e-5 * max(ref, 1.0) + (1e-2 * ref if got.dtype == torch.bfloat16 else 0.0)
    print(f"{'ok  ' if ok else 'FAIL'} {what}: max err {err:.3g} of {ref:.3g}")
    return ok


def check_ragged_m(n, k, recipe, out_dtype, rows=False, tma=False):
    """rows: per-tensor A scales one per row; tma: through TMA descriptors (the sm_90 gate
    bypassed; K past its last whole block reads as zeros)."""
    with mock.patch.object(gg, "_tma_runs", lambda device: tma):
        return _ragged_m(n, k, recipe, out_dtype, rows, "TMA" if tma else "pointers")


def _ragged_m(n, k, recipe, out_dtype, rows, how):
    m, groups = sum(SIZES), len(SIZES)
    a, b = _fp8((m, k)), _fp8((groups, n, k))
    kb, nb = -(-k // 128), -(-n // 128)
    if recipe == "blockwise":
        a_s, b_s = torch.rand(m, kb) + 0.5, torch.rand(groups, nb, kb) + 0.5
    else:
        a_s, b_s = torch.rand(m) + 0.5 if rows else torch.tensor(0.75), torch.rand(groups) + 0.5
    recipe_name = f"{recipe}{' row scales' if rows else ''} ({how})"
    args = dict(a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=SIZES, recipe=recipe)
    want = gg.grouped_scaled_mm(a, b, **args, out_dtype=out_dtype, emulate=True)
    got = gg.grouped_scaled_mm(a, b, **args, out_dtype=out_dtype)
    ok = _close(got, want, f"ragged-M {recipe_name} N={n} K={k} {out_dtype}")
    args["group_sizes"] = torch.tensor(SIZES)  # on the device: the same schedule, built there
    got = gg.grouped_scaled_mm(a, b, **args, out_dtype=out_dtype)
    what = f"ragged-M {recipe_name} N={n} K={k} {out_dtype}, device sizes"
    return ok & _close(got, want, what)


def check_ragged_k(n, k, scales, out_dtype):
    m, groups = sum(SIZES), len(SIZES)
    a_t, b_t = _fp8((n, m), E5M2), _fp8((k, m))
    chunks = sum(-(-s // 128) for s in SIZES)
    recipe = "blockwise" if scales == "blockwise" else "tensorwise"
    segment_group = [0, 0, 1, 2, 2, 2, 3] if scales == "segmented" else None
    if scales == "blockwise":
        a_s, b_s = torch.rand(n, chunks) + 0.5, torch.rand(k, chunks) + 0.5
    elif scales in ("per_group", "segmented"):
        a_s, b_s = torch.rand(groups) + 0.5, torch.rand(groups) + 0.5
    else:
        a_s, b_s = torch.tensor(0.75), torch.tensor(1.25)
    args = dict(a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=SIZES, recipe=recipe)
    args["segment_group"] = segment_group
    want = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, out_dtype=out_dtype, emulate=True)
    got = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, out_dtype=out_dtype)
    ok = _close(got, want, f"ragged-K {scales} N={n} K={k} {out_dtype}")
    if segment_group:  # each group's segments, scaled and summed one by one in fp32
        pieces = [
            gg.grouped_scaled_mm_wgrad(
                a_t, b_t, a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=SIZES, recipe=recipe,
                emulate=True,
            )[s] for s in range(len(SIZES))
        ]  # fmt: skip
        by_hand = torch.stack([sum(p for p, g in zip(pieces, segment_group) if g == group)
                               for group in range(4)]).to(out_dtype)  # fmt: skip
        ok &= _close(want, by_hand, f"ragged-K segmented emulation = sum of segments {n} {k}")
    # Device sizes with tokens and scale cells left unused past the last group (a padded copy
    # of the most rows any sizes need), random bytes there: the kernel must not read them.
    extra = 3 * 128
    a_t, b_t = torch.cat([a_t, _fp8((n, extra), E5M2)], 1), torch.cat([b_t, _fp8((k, extra))], 1)
    if scales == "blockwise":
        a_s, b_s = torch.cat([a_s, torch.rand(n, 3) * 9], 1), torch.cat([b_s, torch.rand(k, 3)], 1)
    args.update(a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=torch.tensor(SIZES))
    got = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, out_dtype=out_dtype)
    return ok & _close(got, want, f"ragged-K {scales} N={n} K={k} {out_dtype}, device sizes")


def check_ragged_k_whole(n, k, scales, tma=False):
    """whole_tiles: groups of whole 128-token tiles (padded operands), unmasked aligned loads,
    rows past N and K clamped and dropped at the store; tma: through TMA descriptors (the
    sm_90 gate bypassed), rows past N and K read as zeros."""
    with mock.patch.object(gg, "_tma_runs", lambda device: tma):
        return _ragged_k_whole(n, k, scales, "TMA" if tma else "pointers")


def _ragged_k_whole(n, k, scales, how):
    sizes = [0, 128, 384, 0, 256]
    m, groups = sum(sizes), len(sizes)
    a_t, b_t = _fp8((n, m), E5M2), _fp8((k, m))
    recipe = "blockwise" if scales == "blockwise" else "tensorwise"
    segment_group = [0, 0, 1, 1, 2] if scales == "segmented" else None
    if scales == "blockwise":
        a_s, b_s = torch.rand(n, m // 128) + 0.5, torch.rand(k, m // 128) + 0.5
    else:
        a_s, b_s = torch.rand(groups) + 0.5, torch.rand(groups) + 0.5
    args = dict(a_scale_inv=a_s, b_scale_inv=b_s, recipe=recipe, segment_group=segment_group)
    want = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, group_sizes=sizes, emulate=True)
    ok = True
    for given in (sizes, torch.tensor(sizes)):
        got = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, group_sizes=given, whole_tiles=True)
        what = f"ragged-K whole tiles ({how}) {scales} N={n} K={k} {type(given).__name__}"
        ok &= _close(got, want, what)
    return ok


def check_strided_operands():
    """Operands as the fused quantizers lay them out: a 1x128 scale grid [M, K/128] that is a
    view of [K/128, M] (outer-dim-major), bytes that are views of transposed copies."""
    m, n, k, groups = sum(SIZES), 144, 256, len(SIZES)
    a = _fp8((k, m)).t()  # [M, K], M-contiguous
    b = _fp8((groups, k, n)).transpose(1, 2)
    a_s = (torch.rand(k // 128, m) + 0.5).t()
    b_s = (torch.rand(groups, k // 128, 2) + 0.5).transpose(1, 2)
    args = dict(a_scale_inv=a_s, b_scale_inv=b_s, group_sizes=SIZES, recipe="blockwise")
    want = gg.grouped_scaled_mm(a, b, **args, out_dtype=torch.float32, emulate=True)
    got = gg.grouped_scaled_mm(a, b, **args, out_dtype=torch.float32)
    ok = _close(got, want, "ragged-M blockwise, strided operands and scale grids")
    a_t, b_t = _fp8((m, n), E5M2).t(), _fp8((m, k)).t()
    args = dict(a_scale_inv=torch.tensor(0.5), b_scale_inv=torch.tensor(2.0), group_sizes=SIZES)
    want = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, recipe="tensorwise", emulate=True)
    got = gg.grouped_scaled_mm_wgrad(a_t, b_t, **args, recipe="tensorwise")
    return ok & _close(got, want, "ragged-K tensorwise, strided operands")


def check_torch_grouped_mm_on_meta():
    """grouped_fp8's torch._scaled_grouped_mm call (forward and dgrad layouts) through torch's
    meta checks (strides, scale shapes, offsets), its CUDA gate bypassed."""
    applies = gf._torch_mm_applies

    class _OnCuda:
        def __init__(self, t):
            self.t = t

        def __getattr__(self, name):
            return True if name == "is_cuda" else getattr(self.t, name)

    on_cuda = lambda a, b, recipe, out: applies(_OnCuda(a), b, recipe, out)  # noqa: E731
    with mock.patch.object(gf, "_torch_mm_applies", on_cuda):
        return _torch_grouped_mm_checks()


def _torch_grouped_mm_checks():
    seg_sizes, seg_expert = torch.tensor([3, 0, 5, 130, 0, 7]), [0, 0, 1, 1, 2, 3]
    m, n, k, experts = int(seg_sizes.sum()), 144, 160, 4
    meta = dict(device="meta")
    w, w_s = torch.empty(experts, n, k, dtype=E4M3, **meta), torch.empty(experts, **meta)
    ok = True
    for name, a, b_op in (
        ("fprop", torch.empty(m, k, dtype=E4M3, **meta), (w, w_s)),
        ("dgrad", torch.empty(m, n, dtype=E4M3, **meta), ops.transposed_experts(w, w_s)),
    ):
        a_s = torch.empty(m, **meta)  # one per row, its segment's
        y = gf._cuda_mm(a, a_s, *b_op, seg_sizes, seg_expert, "tensorwise", torch.bfloat16, True)
        good = y.shape == (m, b_op[0].shape[1]) and y.dtype == torch.bfloat16
        print(f"{'ok  ' if good else 'FAIL'} torch._scaled_grouped_mm {name} on meta: {y.shape}")
        ok &= good
    # An operand at an address that is not 16-byte aligned (an FP8 parameter's bytes inside
    # the engine's buffer) takes the Triton kernel: torch's grouped GEMM refuses it.
    flat = torch.empty(experts * n * k + 1, dtype=torch.uint8)
    unaligned = flat[1:].view(experts, n, k).view(E4M3)
    x = torch.empty(m, k, dtype=E4M3)
    took = (
        gf._torch_mm_applies(
            x, flat[:-1].view(experts, n, k).view(E4M3), "tensorwise", torch.bfloat16
        ),
        gf._torch_mm_applies(x, unaligned, "tensorwise", torch.bfloat16),
    )
    good = took == (True, False)
    print(f"{'ok  ' if good else 'FAIL'} torch path only for 16-byte aligned operands: {took}")
    return ok and good


def check_grouped_fp8(recipe, segments, n, k, w_dtype):
    """grouped_fp8's CUDA wrappers (`_cuda_mm`, `_cuda_wgrad`) against its CPU twins."""
    torch.manual_seed(3)
    config = Fp8Config(recipe=recipe)
    spec = config.spec
    seg_sizes = torch.tensor([c for counts in segments for c in counts])
    seg_expert = [e for e, counts in enumerate(segments) for _ in counts]
    experts, rows = len(segments), int(seg_sizes.sum())
    tokens = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = torch.randn(experts, n, k, dtype=w_dtype) * 0.05
    dy = torch.randn(rows, n, dtype=torch.bfloat16)
    padded = ops.padded_rows(seg_sizes, rows, 128)  # device sizes: the static bound
    r = gf.routing(seg_sizes, seg_expert, experts, rows, padded)
    x_row, x_col = gf._quantize_tokens(tokens, r, seg_sizes, config, "input", False,
                                       columnwise=padded)  # fmt: skip
    dy_row, dy_col = gf._quantize_tokens(dy, r, seg_sizes, config, "grad", False,
                                         columnwise=padded)  # fmt: skip
    w = ops.quantize_experts(weight, spec=spec, fp8_dtype=E4M3, power_2_scale=False)
    w_t = ops.transposed_experts(*w)
    ok = True
    layout = (seg_sizes, seg_expert, spec.name, torch.bfloat16)
    for name, a_op, b_op in (("fprop", x_row, w), ("dgrad", dy_row, w_t)):
        want = gf._emulated_mm(*a_op, *b_op, *layout)
        got = gf._cuda_mm(*a_op, *b_op, *layout, name == "fprop")
        ok &= _close(got, want, f"grouped_fp8 {recipe} {name} {segments} N={n} K={k}")
    wl = (seg_sizes, seg_expert, spec.name)
    want = gf._emulated_wgrad(*dy_col, *x_col, *wl, torch.zeros(experts, n, k, dtype=w_dtype))
    got = gf._cuda_wgrad(*dy_col, *x_col, *wl, (experts, n, k), w_dtype, padded)
    ok &= _close(got, want, f"grouped_fp8 {recipe} wgrad {segments} {w_dtype}")
    ok &= got.dtype == w_dtype and got.shape == (experts, n, k)
    return ok


def check_transpose_bytes():
    """The byte-transpose kernel (its CUDA gate bypassed) against torch, exactly."""
    from tests.unit_tests.fp8.test_grouped_gemm import _byte_cases

    ok = True
    for data, source, want in _byte_cases("cpu"):
        got = gg.transpose_bytes(data, source)
        good = got.dtype == data.dtype and torch.equal(got.view(torch.uint8), want)
        shapes = f"{tuple(data.shape)} -> {tuple(got.shape)}"
        print(f"{'ok  ' if good else 'FAIL'} transpose_bytes {shapes}")
        ok &= good
    return ok


def check_layer_flow():
    """Fp8StackedLinear's grouped function (forward, input and weight gradients) with its GEMM
    ops running their CUDA branches, against the same layer on the CPU emulation: the layers,
    data and segments of tests/unit_tests/models/moe/test_grouped_fp8_blockwise_params.py;
    with one segment per expert also with the token counts on the device."""
    from tests.unit_tests.models.moe import test_grouped_fp8_blockwise_params as t

    def cuda_mm(a, a_s, b, b_s, seg_sizes, seg_expert, recipe, out_dtype, fast, r):
        assert len(r) == gf.ROUTING  # the layer's routing, built once in its forward
        return gf._cuda_mm(a, a_s, b, b_s, seg_sizes, seg_expert, recipe, out_dtype, fast, r)

    def cuda_wgrad(dy, dy_s, x, x_s, seg_sizes, seg_expert, experts, recipe, out_dtype, pad, r):
        assert len(r) == gf.ROUTING
        shape = (experts, *gf._wgrad_dims(dy, x, recipe))
        args = (seg_sizes, seg_expert, recipe, shape, out_dtype, pad, r)
        return gf._cuda_wgrad(dy, dy_s, x, x_s, *args)

    ok = True
    for recipe in ("tensorwise", "blockwise"):
        for fp8_param in (False, True):
            for fp8_format in ("hybrid", "e4m3"):
                for dtype in (torch.float32, torch.bfloat16):
                    for segments in (t.SEGMENTS, t.EP_SEGMENTS, "device"):
                        on_device = segments == "device"
                        segments = [[sum(c)] for c in t.SEGMENTS] if on_device else segments
                        options = dict(dtype=dtype, fp8_param=fp8_param, fp8_format=fp8_format)
                        x, dy = t._data(segments, dtype)
                        want = t._run(t._layer(recipe, **options), x, dy, segments, True)
                        with (
                            mock.patch.object(gf, "grouped_fp8_mm", cuda_mm),
                            mock.patch.object(gf, "grouped_fp8_wgrad", cuda_wgrad),
                        ):
                            layer = t._layer(recipe, **options)
                            got = t._run(layer, x, dy, segments, True, on_device=on_device)
                        what = f"{recipe} param={fp8_param} {fp8_format} {dtype} {segments}"
                        what += " device counts" if on_device else ""
                        for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
                            ok &= a.dtype == b.dtype and a.shape == b.shape
                            ok &= _close(a, b, f"layer {name} {what}")
    return ok


def main():
    torch.manual_seed(0)
    ok = True
    for block_n in (128, 256):
        with _patched(block_n):
            for n, k in ((64, 128), (130, 200), (256, 384)):
                for recipe in ("tensorwise", "blockwise"):
                    ok &= check_ragged_m(n, k, recipe, torch.float32)
                for scales in ("scalar", "per_group", "segmented", "blockwise"):
                    ok &= check_ragged_k(n, k, scales, torch.float32)
            ok &= check_ragged_m(130, 256, "tensorwise", torch.bfloat16)
            ok &= check_ragged_k(130, 200, "per_group", torch.bfloat16)
            ok &= check_ragged_k(130, 200, "segmented", torch.bfloat16)
            for scales, tma in itertools.product(("per_group", "segmented", "blockwise"), (0, 1)):
                ok &= check_ragged_k_whole(130, 200, scales, tma)
            for (n, k), tma in itertools.product(((130, 208), (256, 384)), (0, 1)):
                ok &= check_ragged_m(n, k, "tensorwise", torch.float32, rows=True, tma=tma)
                ok &= check_ragged_m(n, k, "blockwise", torch.float32, tma=tma)
                ok &= check_ragged_m(n, k, "tensorwise", torch.bfloat16, tma=tma)
    with _patched(128):
        ok &= check_strided_operands()
        ok &= check_transpose_bytes()
        ok &= check_torch_grouped_mm_on_meta()
        ok &= check_layer_flow()
        for recipe in ("tensorwise", "blockwise"):
            for segments in ([[3], [0], [130], [128]], [[2, 0], [1, 129], [0, 0], [5, 127]]):
                for w_dtype in (torch.float32, torch.bfloat16):
                    ok &= check_grouped_fp8(recipe, segments, 144, 160, w_dtype)
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
