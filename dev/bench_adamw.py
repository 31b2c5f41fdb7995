"""How fast is one AdamW step over Model A's parameters (2.2 B fp32, the shapes of the FSDP
engine's DP=1 pieces): torch's fused AdamW against FusedAdamW's Triton pass, with and without
the amax output, with bf16 moments and with fp8 moments (per-tensor and per-block scales), and
FusedAdamW with use_triton=False (its torch step), each with a grad_scale (the folded clip).
Needs a CUDA GPU.

    python3 dev/bench_adamw.py                          # one JSON line per variant
    python3 dev/bench_adamw.py --variants triton triton_bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron.core.optimizer import FusedAdamW  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS = 4096, 14336, 32768, 8
VARIANTS = {
    "torch_fused": None,
    "fused_adamw_torch_step": {"use_triton": False},
    "triton": {},
    "triton_amax": {},
    "triton_bf16": {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
    "triton_fp8_tensor": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"},
    "triton_fp8_block": {
        "exp_avg_dtype": "fp8",
        "exp_avg_sq_dtype": "fp8",
        "moment_scaling": "block",
    },
}
"""Variant name -> FusedAdamW's keyword arguments (None: torch.optim.AdamW(fused=True))."""


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
    options = VARIANTS[variant]
    if options is None:
        optimizer = torch.optim.AdamW(groups, lr=1e-5, fused=True)
    else:
        optimizer = FusedAdamW(groups, lr=1e-5, fused=True, **options)
        assert optimizer._triton_usable() == options.get("use_triton", True)
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
    state_bytes = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if key != "step"
    )
    return {
        "variant": variant,
        "params": numel,
        "step_ms": round(median, 3),
        "state_bytes_per_param": round(state_bytes / numel, 3),
        # param read+write 8, grad read 4, moments read+write 2x their bytes
        "TB_per_s": round((12 + 2 * state_bytes / numel) * numel / median / 1e9, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    for variant in parser.parse_args().variants:
        print(json.dumps(run(variant)), flush=True)
        torch.cuda.empty_cache()
