"""Benchmark one GPT training step under Megatron-FSDP or PyTorch FSDP2; print one JSON line.

Model A of docs PERFORMANCE.md by default (8 layers, hidden 4096, SwiGLU FFN 14336, 32 heads,
vocab 32768, seq 4096, micro-batch 2, untied head), ZeRO-3, bf16 compute, fp32 main params and
grads. Launch:

    torchrun --nproc-per-node 2 benchmarks/bench_gpt.py --engine megatron-fsdp [--compile]
    torchrun --nproc-per-node 2 benchmarks/bench_gpt.py --engine fsdp2
    torchrun --nproc-per-node 2 benchmarks/bench_gpt.py --tiny --steps 4   # CPU dry run on gloo
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.linear import apply_fp8_setup
from megatron.core.models.gpt import GPTModel, num_floating_point_operations
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.model_setup import compile_layers, compile_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["megatron-fsdp", "fsdp2"], default="megatron-fsdp")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--ffn-hidden-size", type=int, default=14336)
    parser.add_argument("--num-attention-heads", type=int, default=32)
    parser.add_argument("--num-query-groups", type=int, default=None, help="GQA (default: MHA)")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warmup")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each layer and the loss"
    )
    parser.add_argument(
        "--backward-worker-threads",
        action="store_true",
        help="backward on the autograd engine's device thread (PyTorch's default) instead of "
        "the calling thread (pretrain_gpt.py's default)",
    )
    parser.add_argument(
        "--fp8-recipe",
        choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
        default=None,
        help="FP8 transformer Linears (megatron-fsdp engine only), hybrid format",
    )
    parser.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="keep weights only in FP8 and all-gather FP8 bytes (needs --fp8-recipe)",
    )
    parser.add_argument(
        "--torchao-float8",
        choices=["tensorwise", "rowwise"],
        default=None,
        help="the torchao peer (--engine fsdp2 only): convert the transformer Linears with "
        "torchao.float8 as torchtitan does (tensorwise: FP8 all-gather of the weights and "
        "scales precomputed after each step; rowwise: torchao's rowwise recipe); the output "
        "head stays bf16 as in our FP8 rows",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="measured bf16 dense peak, for MFU"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="2 layers, hidden 64, seq 64: a CPU dry run"
    )
    parser.add_argument(
        "--memory-report",
        default=None,
        metavar="FILE",
        help="record the CUDA allocator during one more step and write, to FILE on rank 0, "
        "what was alive at that step's peak (grouped by the allocating source line)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="after the timed steps, profile 2 more steps (torch.profiler) and write the op "
        "tables (by device time and by host time) to FILE on rank 0",
    )
    parser.add_argument(
        "--sync-report",
        default=None,
        metavar="FILE",
        help="run one more step with CUDA's sync debug mode on and write, to FILE on rank 0, "
        "every host-device synchronization it made: count and Python stack, most frequent "
        "first",
    )
    args = parser.parse_args()
    if args.fp8_recipe and args.engine != "megatron-fsdp":
        parser.error("--fp8-recipe is measured with --engine megatron-fsdp only")
    if args.torchao_float8 and args.engine != "fsdp2":
        parser.error("--torchao-float8 is the FSDP2 peer: use it with --engine fsdp2")
    if args.fp8_param_gather and not args.fp8_recipe:
        parser.error("--fp8-param-gather needs --fp8-recipe")
    if args.tiny:
        args.num_layers, args.hidden_size, args.ffn_hidden_size = 2, 64, 128
        args.num_attention_heads, args.vocab_size, args.seq_length = 4, 256, 64
        args.warmup_steps = min(args.warmup_steps, 2)
    return args


def model_config(args: argparse.Namespace, params_dtype: torch.dtype) -> TransformerConfig:
    fp8 = None
    if args.fp8_recipe:
        fp8 = Fp8Config(recipe=args.fp8_recipe, fp8_param_gather=args.fp8_param_gather)
    return TransformerConfig(
        fp8=fp8,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=True,
        params_dtype=params_dtype,
    )


def build_megatron_fsdp(args, device):
    config = model_config(args, torch.bfloat16)
    with torch.device("meta"):
        model = GPTModel(config)
    if config.fp8 is not None:  # as pretrain_gpt.py's model setup does (setup_fp8)
        apply_fp8_setup(model, fp8_config=config.fp8, amax_reduction_group=dist.group.WORLD)
    if args.compile:
        compile_layers(model)  # as pretrain_gpt.py --torch-compile does
    model = FullyShardedDataParallel(
        model,
        fsdp_config=FsdpConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_param_gather=True,
            overlap_grad_reduce=True,
            init_model_with_meta_device=True,
        ),
        device=device,
        init_fn=lambda name, t: init_parameter_(t, name=name, config=config, seed=0),
        fp8_config=config.fp8,
    )
    optimizer = model.build_optimizer(OptimizerConfig(lr=1e-5, clip_grad=1.0))
    return config, model, optimizer


def build_fsdp2(args, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    config = model_config(args, torch.float32)  # FSDP2 keeps fp32 shards, computes in bf16
    with torch.device("meta"):
        model = GPTModel(config)
    if args.torchao_float8:
        convert_torchao_float8(model, args.torchao_float8)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        if args.compile:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    if args.compile:  # the loss compiled too, as compile_layers does for our rows
        compile_loss(model)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    with torch.no_grad():  # the same init values, one full tensor at a time, then sharded
        for name, param in model.named_parameters():
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            init_parameter_(full, name=name, config=config, seed=0)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    model.init_buffers(device)
    # The strongest stock optimizer: fused AdamW on CUDA (foreach, the default, ran 10% slower
    # on Model A), with the same clipping as our engine (run_step).
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, weight_decay=0.01, fused=device.type == "cuda"
    )
    return config, model, optimizer


def convert_torchao_float8(model: torch.nn.Module, recipe: str) -> None:
    """torchao's float8 training on the decoder's Linears (torchtitan's order: convert, then
    compile, then shard). An optional dependency of this benchmark only."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise SystemExit(f"--torchao-float8 needs torchao ({error}); pip install torchao") from None
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(
        model.decoder, config=config, module_filter_fn=lambda module, name: "linear" in name
    )


def run_step(args, engine, model, optimizer, inputs, labels) -> None:
    if engine == "megatron-fsdp":
        model.zero_grad_buffer()
        loss = model(inputs, labels=labels).mean()  # FP8 settings from apply_fp8_setup
        with torch.autograd.set_multithreading_enabled(args.backward_worker_threads):
            loss.backward()
        model.finish_grad_sync()
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs, labels=labels).mean()
        with torch.autograd.set_multithreading_enabled(args.backward_worker_threads):
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.torchao_float8 == "tensorwise":
            # The weights' FP8 scales for the next step's all-gather, in one pass (torchtitan)
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


def profile_steps(args, model, optimizer, inputs, labels, steps: int = 2) -> None:
    """Two more steps under torch.profiler; the op tables go to args.profile (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step(args, args.engine, model, optimizer, inputs, labels)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return
    table = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(args.profile, "w") as out:
        out.write(f"# {steps} steps; sorted by {device_key}\n")
        out.write(table.table(sort_by=device_key, row_limit=45, max_name_column_width=70))
        out.write("\n# sorted by cpu_time_total\n")
        out.write(table.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70))


def sync_report(args, model, optimizer, inputs, labels) -> None:
    """One step under torch.cuda.set_sync_debug_mode("warn"): each synchronizing call warns
    from the Python frame that made it; the stacks are counted and written (rank 0)."""
    stacks: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            frames = traceback.format_stack(limit=14)[:-1]
            stacks["".join(frames)] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step(args, args.engine, model, optimizer, inputs, labels)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if dist.get_rank() != 0:
        return
    with open(args.sync_report, "w") as out:
        out.write(f"# {sum(stacks.values())} synchronizations in one step\n")
        for stack, count in stacks.most_common():
            out.write(f"\n## {count} x\n{stack}")


def _allocation_site(frames: list[dict]) -> str:
    """The innermost frame of this repository's code (else torch's) that made an allocation."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/megatron/" in name or "/scripts/" in name:
            return f"{name.split('/megatron/')[-1]}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{frame['filename'].split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "(no python frame)"


def memory_report(args, model, optimizer, inputs, labels) -> None:
    """One step under the allocator's recorder; replay its trace to find the peak and write
    the allocations alive there, grouped by source line, largest first (rank 0)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    run_step(args, args.engine, model, optimizer, inputs, labels)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if dist.get_rank() != 0:
        return
    events = snapshot["device_traces"][torch.cuda.current_device()]
    alive: dict[int, dict] = {}
    current = peak = 0
    peak_alive: dict[int, dict] = {}
    for event in events:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_alive = current, dict(alive)
        elif event["action"] == "free_completed":
            # Blocks allocated before recording (last step's grads, say) count when freed too.
            alive.pop(event["addr"], None)
            current -= event["size"]
    by_site: dict[str, list[int]] = {}
    for event in peak_alive.values():
        by_site.setdefault(_allocation_site(event.get("frames", [])), []).append(event["size"])
    with open(args.memory_report, "w") as out:
        out.write(
            f"allocated before the step: {base / 2**30:.3f} GiB; "
            f"peak within the step: {peak / 2**30:+.3f} GiB\n"
        )
        out.write("GiB alive at the peak  count  allocated at\n")
        for site, sizes in sorted(by_site.items(), key=lambda item: -sum(item[1]))[:40]:
            out.write(f"{sum(sizes) / 2**30:10.3f}  {len(sizes):6d}  {site}\n")


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    build = build_megatron_fsdp if args.engine == "megatron-fsdp" else build_fsdp2
    config, model, optimizer = build(args, device)
    generator = torch.Generator().manual_seed(dist.get_rank())
    shape = (args.micro_batch_size, args.seq_length + 1)
    tokens = torch.randint(0, args.vocab_size, shape, generator=generator).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times_ms = []
    for step in range(args.warmup_steps + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run_step(args, args.engine, model, optimizer, inputs, labels)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup_steps:
            times_ms.append((time.perf_counter() - start) * 1e3)
    step_ms = statistics.median(times_ms)
    tokens_per_step = args.micro_batch_size * args.seq_length
    flops = num_floating_point_operations(
        config, batch_size=args.micro_batch_size, seq_length=args.seq_length
    )
    tflops = flops / (step_ms / 1e3) / 1e12
    if cuda:
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
    else:  # CPU dry run: the process's peak resident set (kilobytes on Linux)
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    stats = model.comm_stats() if args.engine == "megatron-fsdp" else {}
    if args.profile:
        profile_steps(args, model, optimizer, inputs, labels)
    if args.memory_report and cuda:
        memory_report(args, model, optimizer, inputs, labels)
    if args.sync_report and cuda:
        sync_report(args, model, optimizer, inputs, labels)
    result = {
        "engine": args.engine,
        "fp8_recipe": args.fp8_recipe,
        "fp8_param_gather": args.fp8_param_gather,
        "torchao_float8": args.torchao_float8,
        "compile": args.compile,
        "world_size": dist.get_world_size(),
        "step_ms": round(step_ms, 3),
        "tokens_per_s_per_gpu": round(tokens_per_step / (step_ms / 1e3), 1),
        "model_tflops_per_gpu": round(tflops, 2),
        "mfu": round(tflops / args.peak_tflops, 4) if args.peak_tflops else None,
        "peak_mem_gib": round(peak_gib, 3),
        "all_gather_bytes": stats.get("all_gather_bytes"),
        "reduce_scatter_bytes": stats.get("reduce_scatter_bytes"),
        "fp8_all_gather_bytes": stats.get("fp8_all_gather_bytes"),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
