"""Where the Triton grouped GEMM differs from its emulation on the GPU: per group, per 16-column
and 32-k band, the largest error (investigation for issue 38)."""

import torch

from megatron.core.fp8.cuda.grouped_gemm import grouped_scaled_mm
from tests.unit_tests.fp8.test_grouped_gemm import E4M3, SIZES, K, M, _quantized, _weights

torch.manual_seed(0)
for recipe in ("tensorwise", "blockwise"):
    a, a_scale, _ = _quantized(torch.randn(M, K, device="cuda"), recipe, "input", E4M3)
    b, b_scale, _ = _weights(recipe, "cuda")
    kw = dict(a_scale_inv=a_scale, b_scale_inv=b_scale, group_sizes=SIZES, recipe=recipe)
    got = grouped_scaled_mm(a, b, out_dtype=torch.float32, **kw)
    want = grouped_scaled_mm(a, b, out_dtype=torch.float32, emulate=True, **kw)
    err = (got - want).abs()
    start = 0
    for g, size in enumerate(SIZES):
        part = err[start : start + size]
        if size:
            cols = part.amax(0).reshape(-1, 16).amax(1)
            rows = part.amax(1)
            print(
                recipe,
                "group",
                g,
                "max",
                part.max().item(),
                "cols16",
                [f"{c:.1e}" for c in cols.tolist()],
                "bad rows",
                (rows > 1e-4).nonzero().flatten().tolist()[:20],
                "want max",
                want[start : start + size].abs().max().item(),
            )
        start += size
    # single-group check: same data through one group
    one = grouped_scaled_mm(
        a[:70],
        b[:1],
        out_dtype=torch.float32,
        group_sizes=[70],
        recipe=recipe,
        a_scale_inv=a_scale if a_scale.numel() == 1 else a_scale[:70],
        b_scale_inv=b_scale[:1],
    )
    ref = a[:70].float() @ b[0].float().t()
    print(
        recipe, "one group vs raw fp32 product (unscaled ratio)", (one / ref).flatten()[:4].tolist()
    )
