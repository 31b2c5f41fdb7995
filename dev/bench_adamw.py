"""How fast is one AdamW step over Model A's parameters (2.2 B fp32, the shapes of the FSDP
engine's DP=1 pieces): torch's fused AdamW against FusedAdamW's Triton pass, with and without
the amax output, each with a grad_scale (the folded clip). Needs a CUDA GPU.

    python3 dev/bench_adamw.py    # prints one JSON line per variant
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron.core.optimizer import FusedAdamW  # noqa: E402
from megatron.core.optimizer.fused_adamw import TORCH_ADAMW_ENV  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS = 4096, 14336, 32768, 8


def model_a_numels() -> list[int]:
    layer = [3 * HIDDEN * HIDDEN, HIDDEN * HIDDEN, 2 * FFN * HIDDEN, HIDDEN * FFN, HIDDEN, HIDDEN]
    return [VOCAB * HIDDEN] + layer * LAYERS + [HIDDEN, VOCAB * HIDDEN]


def run(variant: str, iters: int = 10) -> dict:
    torch.manual_seed(0)
    params = [torch.randn(1, n, device="cuda") * 0.02 for n in model_a_numels()]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    groups = [
        {"params": [p for p in params if p.numel() > HIDDEN], "weight_decay": 0.1},
        {"params": [p for p in params if p.numel() <= HIDDEN], "weight_decay": 0.0},
    ]
    if variant == "torch_fused":
        optimizer = torch.optim.AdamW(groups, lr=1e-5, fused=True)
    else:
        os.environ[TORCH_ADAMW_ENV] = "0"
        optimizer = FusedAdamW(groups, lr=1e-5, fused=True)
        assert optimizer._triton_usable()
    amaxes = torch.zeros(len(params), device="cuda")
    times = []
    for i in range(iters + 3):
        optimizer.grad_scale = torch.tensor(1.5, device="cuda")
        if variant == "triton_amax":
            amaxes.zero_()
            optimizer.amax_targets = {p: amaxes[k] for k, p in enumerate(params)}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    numel = sum(p.numel() for p in params)
    median = sorted(times)[len(times) // 2]
    return {
        "variant": variant,
        "params": numel,
        "step_ms": round(median, 3),
        "TB_per_s": round(28 * numel / median / 1e9, 2),
    }


if __name__ == "__main__":
    for variant in ("torch_fused", "triton", "triton_amax", "torch_fused"):
        print(json.dumps(run(variant)), flush=True)
        torch.cuda.empty_cache()
