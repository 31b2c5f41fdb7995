"""Host time of the routed experts' FP8 paths at tiny shapes, where compute is negligible:
one forward and backward of Fp8StackedLinear inside fp8_autocast (delayed scaling flushes once
per pass, as in training), per recipe. Every recipe takes the grouped path (moe/grouped_fp8.py;
mxfp8 moe/grouped_mxfp8.py, where --width is a multiple of 32); the per-segment path is one
Fp8Linear call per expert. On CPU the quantizers are the reference ones; on a GPU each is a
Triton launch.

    python dev/time_expert_paths.py [--experts 64] [--tokens-per-expert 8] [--device cpu]
        [--per-segment]
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.autocast import fp8_autocast
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear


def time_recipe(recipe: str, args: argparse.Namespace) -> float:
    """Mean ms of one forward and backward over `args.repeats` after two warm-up passes."""
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    layer = Fp8StackedLinear(
        args.experts, args.width, args.width, fp8_config=config, dtype=torch.bfloat16,
        device=args.device,
    )  # fmt: skip
    layer.grouped = not args.per_segment
    counts = torch.full((args.experts,), args.tokens_per_expert, device=args.device)
    x = torch.randn(int(counts.sum()), args.width, dtype=torch.bfloat16, device=args.device)

    def step() -> None:
        tokens = x.detach().requires_grad_()
        with fp8_autocast(layer):
            y = layer(tokens, counts)
        y.float().sum().backward()

    for _ in range(2):
        step()
    if args.device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    if args.device != "cpu":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--tokens-per-expert", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--per-segment", action="store_true", help="the per-segment path (one call per expert)"
    )
    parser.add_argument(
        "--recipes", nargs="+", default=["tensorwise", "blockwise", "delayed", "mxfp8"]
    )
    args = parser.parse_args()
    for recipe in args.recipes:
        ms = time_recipe(recipe, args)
        path = "per-segment" if args.per_segment else "grouped"
        print(f"{recipe} ({path}): {ms:.1f} ms per forward and backward of {args.experts} experts")


if __name__ == "__main__":
    main()
