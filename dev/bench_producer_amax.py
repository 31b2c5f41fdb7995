"""A/B of the FP8 debug setting `amax_in_graph` (`megatron.core.fp8.debug`) on one compiled
Model A transformer layer (FP8 parameters, tensorwise by default): forward + backward with
max|x| taken from the graph (fused by Inductor into the producer's kernel) against the cast's
own amax pass, interleaved in one process so that clock drift hits both alike. Prints one
JSON line: ms per layer step for each variant (median over rounds), and from one profiled step
each the GPU time of every kernel, of the amax passes, and the number of launches.

    python3 dev/bench_producer_amax.py --recipe tensorwise --rounds 8 --iters 10
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.fp8 import Fp8Config, fp8_autocast, quantized_model_init
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.debug import set_debug_config
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--kernels", action="store_true", help="GPU us of every kernel by name")
    args = parser.parse_args()
    fp8 = Fp8Config(recipe=args.recipe, fp8_format="hybrid")
    config = TransformerConfig(
        num_layers=1,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        vocab_size=32768,
        max_sequence_length=args.seq,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        position_embedding_type="rope",
        fp8=fp8,
    )
    torch.manual_seed(0)
    with torch.device("cuda"), quantized_model_init(recipe=args.recipe):
        layer = TransformerLayer(config, layer_number=1)
    prepare_for_compile(layer)
    layer.forward = torch.compile(layer.forward)
    rope = RotaryEmbedding(config).cuda()
    positions = torch.arange(args.seq, device="cuda").expand(args.micro_batch, -1)
    cos_sin = rope(positions)
    shape = (args.micro_batch, args.seq, config.hidden_size)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 1e-3

    def step() -> None:
        with fp8_autocast(layer, enabled=True, fp8_config=fp8):
            y = layer(x, cos_sin)
        y.backward(dy)
        x.grad = None
        for param in layer.parameters():
            param.grad = None

    variants = {"amax_in_graph": True, "amax_pass": False}
    for fused in variants.values():  # compile both graphs (the flag is guarded), warm up
        set_debug_config(amax_in_graph=fused)
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fused in variants.items():
            set_debug_config(amax_in_graph=fused)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / args.iters)
    result = {"recipe": args.recipe, "tokens": args.seq * args.micro_batch}
    for name, fused in variants.items():
        set_debug_config(amax_in_graph=fused)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.device_time for e in kernels)
        amax_us = sum(e.device_time for e in kernels if "amax_partials" in e.name)
        in_graph = [e for e in kernels if "amax" in e.name and "amax_partials" not in e.name]
        result[name] = {
            "ms_median": round(statistics.median(times[name]), 3),
            "ms_rounds": [round(t, 3) for t in times[name]],
            "gpu_kernel_ms": round(gpu_us / 1000, 3),
            "amax_pass_ms": round(amax_us / 1000, 3),
            "launches": len(kernels),
            "inductor_amax_kernels": sorted({e.name for e in in_graph}),
            "inductor_amax_ms": round(sum(e.device_time for e in in_graph) / 1000, 3),
        }
        if args.kernels:
            by_name: dict[str, float] = {}
            for event in kernels:
                by_name[event.name] = by_name.get(event.name, 0.0) + event.device_time
            result[name]["kernels_us"] = {k: round(v, 1) for k, v in sorted(by_name.items())}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
