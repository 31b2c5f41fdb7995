"""One launch of each FP8 quantization kernel on an 8192 x 8192 bf16 tensor, for Nsight Compute.

Every case runs twice first (compiles, warms the launch cache), then once more between
cudaProfilerStart and cudaProfilerStop, so that ncu profiles exactly one launch of each kernel:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 dev/profile_quantize_kernels.py

The cases are those of bench_fp8.py's quantization table whose kernels missed 60% of copy
bandwidth, plus the rowwise tensorwise cast and the MX dequantized copies for comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.fp8.cuda import linear_ops, quantize_cuda  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _cases(x: torch.Tensor) -> list:
    scale = torch.tensor(64.0, device=x.device)
    history = torch.zeros(16, device=x.device)

    def operands(recipe: str, role: str):
        delayed = recipe == "delayed"
        return lambda: linear_ops.quantize_operands(
            x,
            recipe=recipe,
            fp8_dtype=E4M3,
            role=role,
            rowwise=True,
            transposed=True,
            power_2_scale=not delayed,
            scale=scale if delayed else None,
            amax_history=history if delayed else None,
        )

    def api(recipe: str, columnwise: bool):
        return lambda: quantize_cuda(
            x,
            recipe=recipe,
            fp8_dtype=E4M3,
            role="input",
            rowwise=True,
            columnwise=columnwise,
            power_2_scale=recipe == "mxfp8",
        )

    return [
        api("tensorwise", columnwise=False),
        operands("delayed", "input"),
        operands("blockwise", "input"),
        operands("blockwise", "weight"),
        api("mxfp8", columnwise=True),
        operands("mxfp8", "input"),
    ]


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_quantize_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    cases = _cases(x)
    for case in cases:
        case()
        case()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case in cases:
        case()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
