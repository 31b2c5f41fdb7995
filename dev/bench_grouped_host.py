"""How much host (Python and launch) time do the MoE experts cost a micro-batch, against
their GPU time? Issue 38: at 8 micro-batches a step, model M's FP8 rows wait for the host
(docs/benchmarks/moe_model_m_accumulation_2026-12-05d.md, section 4).

At model M's expert shape (8,192 tokens top-8 over 64 experts, hidden 2048, expert ffn 768,
SwiGLU), one layer's routed experts (fc1, SwiGLU, fc2) forward and backward:
- bf16: torch._grouped_mm on bf16 weights (what our bf16 row runs);
- FP8 tensorwise / blockwise: two Fp8StackedLinear with FP8 parameters (stand-ins in the
  compiled graph, as training runs them), compiled like a transformer layer;
and each FP8 piece alone (the custom ops as the compiled graph calls them, the byte transpose,
the ragged kernels through their launchers).

Host time: the calls are issued while the GPU sleeps on a long `torch.cuda._sleep`, so no
launch waits for the GPU; their wall time is the host's. GPU time: CUDA events around the
same calls without the sleep. A case whose host time exceeds its GPU time starves the GPU.

    python3 dev/bench_grouped_host.py [--calls 8] [--out /tmp/host.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_grouped_gemm import timed_ms  # noqa: E402
from megatron.core.fp8 import Fp8Config  # noqa: E402
from megatron.core.fp8.compile import prepare_for_compile  # noqa: E402
from megatron.core.fp8.cuda.grouped_gemm import transpose_bytes  # noqa: E402
from megatron.core.fp8.formats import fp8_dtype_for_role  # noqa: E402
from megatron.core.fp8.quantization import quantize  # noqa: E402
from megatron.core.fp8.quantized_tensor import QuantizedTensor  # noqa: E402
from megatron.core.transformer.moe import grouped_fp8  # noqa: E402
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear  # noqa: E402

TOKENS, TOPK, EXPERTS, HIDDEN, FFN = 8192, 8, 64, 2048, 768
SLEEP_CYCLES = 4_000_000_000  # ~2 s at an H100's clock: longer than any batch of calls here


def host_us(fn, calls: int) -> float:
    """Wall time per call while the GPU is busy with a sleep (the host's time alone)."""
    fn(), fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def counts(device) -> torch.Tensor:
    base = TOKENS * TOPK // EXPERTS
    sizes = torch.full((EXPERTS,), base, dtype=torch.int64)
    sizes[::2] += base // 4  # a mild imbalance, still summing to T x k
    sizes[1::2] -= base // 4
    return sizes.to(device)


def fp8_parameter(weight: torch.Tensor, config: Fp8Config) -> torch.nn.Parameter:
    """The stacked FP8 parameter as the engine holds it (each expert quantized alone)."""
    fp8_dtype = fp8_dtype_for_role(config.fp8_format, "weight")
    options = dict(recipe=config.recipe, fp8_dtype=fp8_dtype, role="weight")
    parts = [quantize(weight[e], power_2_scale=config.quantize_power_2_scale, **options)
             for e in range(weight.shape[0])]  # fmt: skip
    stacked = QuantizedTensor(
        shape=weight.shape, dtype=weight.dtype, **options,
        rowwise_data=torch.stack([p.rowwise_data for p in parts]),
        rowwise_scale_inv=torch.stack([p.rowwise_scale_inv for p in parts]),
    )  # fmt: skip
    return torch.nn.Parameter(stacked)


class Fp8Experts(torch.nn.Module):
    def __init__(self, recipe: str, device) -> None:
        super().__init__()
        config = Fp8Config(recipe=recipe, fp8_format="hybrid")
        options = dict(fp8_config=config, dtype=torch.bfloat16, device=device)
        self.fc1 = Fp8StackedLinear(EXPERTS, HIDDEN, 2 * FFN, **options)
        self.fc2 = Fp8StackedLinear(EXPERTS, FFN, HIDDEN, **options)
        for fc in (self.fc1, self.fc2):
            weight = torch.randn(fc.weight.shape, device=device, dtype=torch.bfloat16) * 0.02
            fc.weight = fp8_parameter(weight, config)

    def forward(self, x, sizes):
        gate, up = self.fc1(x, sizes).chunk(2, dim=-1)
        return self.fc2(torch.nn.functional.silu(gate) * up, sizes)


def bf16_experts(device):
    w1 = torch.randn(EXPERTS, 2 * FFN, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, FFN, device=device, dtype=torch.bfloat16) * 0.02
    w1.requires_grad_(), w2.requires_grad_()

    def run(x, sizes):
        offs = sizes.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)

    return torch.compile(run)


def layer_step(layer, x, dy, sizes):
    def step():
        tokens = x.detach().requires_grad_()
        layer(tokens, sizes).backward(dy)

    return step


def piece_cases(device):
    """The FP8 pieces alone, as the compiled graph calls them (tensorwise, fc2's shapes)."""
    sizes = counts(device)
    rows = TOKENS * TOPK
    padded = grouped_fp8.operands.padded_rows(sizes, rows, grouped_fp8.TOKEN_TILE)
    r = grouped_fp8.routing(sizes, list(range(EXPERTS)), EXPERTS, rows, padded)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    h = torch.randn(rows, FFN, device=device).to(e4m3)
    dy = torch.randn(rows, HIDDEN, device=device).to(e5m2)
    w2 = torch.randn(EXPERTS, HIDDEN, FFN, device=device).to(e4m3)
    w2_t = transpose_bytes(w2)
    row_scale = torch.ones(rows, device=device)  # the GEMMs': one per row, its segment's
    seg_scale, w_scale = torch.ones(EXPERTS, device=device), torch.ones(EXPERTS, device=device)
    seg = list(range(EXPERTS))
    mm = torch.ops.megatron_fp8.grouped_fp8_mm.default  # as the compiled graph calls them
    wgrad = torch.ops.megatron_fp8.grouped_fp8_wgrad.default
    common = (sizes, seg, "tensorwise", torch.bfloat16)
    wgrad_args = (sizes, seg, EXPERTS, "tensorwise", torch.bfloat16, padded, r)
    return {
        "fwd fc2 (torch FP8 grouped, fast)": lambda: mm(
            h, row_scale, w2, w_scale, *common, True, r
        ),
        "dgrad fc2 (our ragged-M, E5M2)": lambda: mm(
            dy, row_scale, w2_t, w_scale, *common, False, r
        ),
        "weight transpose fc2": lambda: transpose_bytes(w2),
        "wgrad fc2 (2 padded transposes + ragged-K)": lambda: wgrad(
            dy, seg_scale, h, seg_scale, *wgrad_args
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (host time is measured against the GPU's)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    sizes = counts(device)
    x = torch.randn(TOKENS * TOPK, HIDDEN, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 1e-3
    bf16_layer = layer_step(bf16_experts(device), x, dy, sizes)
    cases = {"layer bf16 (torch._grouped_mm, compiled)": bf16_layer}
    for recipe in ("tensorwise", "blockwise"):
        experts = Fp8Experts(recipe, device)
        experts.forward = torch.compile(experts.forward)
        prepare_for_compile(experts)
        cases[f"layer FP8 {recipe} params (compiled)"] = layer_step(experts, x, dy, sizes)
    cases.update(piece_cases(device))
    rows = []
    for name, fn in cases.items():
        row = {"case": name, "host_us": round(host_us(fn, args.calls), 1),
               "gpu_us": round(timed_ms(fn, args.calls) * 1e3, 1)}  # fmt: skip
        rows.append(row)
        print(f"{row['host_us']:10.1f} {row['gpu_us']:10.1f}  {name}", flush=True)
    if args.out:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
