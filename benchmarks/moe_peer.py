"""The FSDP2 MoE peer of model M (docs/PERFORMANCE.md): a Qwen3-MoE-style GPT in plain torch,
one training step timed; prints one JSON line like bench_gpt.py.

Each layer: RMSNorm, GQA attention with RoPE (SDPA, causal), RMSNorm, a top-k softmax router
(top-k probabilities renormalized, as Megatron-LM's default softmax-after-top-k and Qwen3's
norm_topk_prob), the routed SwiGLU experts as two torch._grouped_mm calls over the tokens
sorted by expert (offsets from a scatter-add: no host sync), no load-balancing loss (the rows of
ours run with --moe-router-load-balancing-type none). FSDP2 with fp32 shards and bf16 compute,
each layer and the loss compiled (--compile), fused AdamW, gradient clipping at 1.0:
bench_gpt.py's peer.
--torchao-fp8-rowwise: torchao's float8 rowwise grouped GEMMs for the experts
(torchao.prototype.moe_training, Float8TrainingOpConfig), converted before compile and shard.

    torchrun --nproc-per-node 1 benchmarks/moe_peer.py --compile [--torchao-fp8-rowwise]
        [--global-batch-size 16]   # 8 micro-batches of 2 per optimizer step
    torchrun --nproc-per-node 1 benchmarks/moe_peer.py --tiny --steps 2   # CPU dry run, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--num-layers", type=int, default=8)
    add("--hidden-size", type=int, default=2048)
    add("--num-attention-heads", type=int, default=32)
    add("--num-query-groups", type=int, default=4)
    add("--num-experts", type=int, default=64)
    add("--moe-router-topk", type=int, default=8)
    add("--moe-ffn-hidden-size", type=int, default=768)
    add("--vocab-size", type=int, default=32768)
    add("--seq-length", type=int, default=4096)
    add("--micro-batch-size", type=int, default=2)
    add(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per optimizer step (gradients accumulated over micro-batches, as "
        "Megatron-LM's flag at DP=1); default: one micro-batch",
    )
    add("--steps", type=int, default=20, help="timed steps after warmup")
    add("--warmup-steps", type=int, default=5)
    add("--compile", action="store_true", help="torch.compile each layer and the loss")
    add("--torchao-fp8-rowwise", action="store_true", help="torchao float8 rowwise experts")
    add("--tiny", action="store_true", help="CPU-sized model for a dry run")
    args = parser.parse_args(argv)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size
    if args.global_batch_size % args.micro_batch_size:
        parser.error("--global-batch-size must be a multiple of --micro-batch-size")
    if args.tiny:
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 64, 4
        args.num_query_groups, args.num_experts, args.moe_router_topk = 2, 8, 2
        args.moe_ffn_hidden_size, args.vocab_size, args.seq_length = 32, 256, 64
        args.warmup_steps = min(args.warmup_steps, 1)
    return args


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [b, heads, s, d] (rotate-half form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, groups: int) -> None:
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim],
            dim=-1,
        )
        q = rope(q.view(b, s, self.heads, self.head_dim).transpose(1, 2))
        k = rope(k.view(b, s, self.groups, self.head_dim).transpose(1, 2))
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Experts(nn.Module):
    """The routed SwiGLU experts: stacked weights [E, out, in], two grouped GEMMs."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.fc2 = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if tokens.is_cuda:
            h = torch._grouped_mm(tokens, self.fc1.transpose(-2, -1), offs=offsets)
        else:  # CPU dry run: a loop (torch._grouped_mm has no CPU backward)
            h = _loop_mm(tokens, self.fc1, offsets)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        if tokens.is_cuda:
            return torch._grouped_mm(h, self.fc2.transpose(-2, -1), offs=offsets)
        return _loop_mm(h, self.fc2, offsets)


def _loop_mm(tokens, weight, offsets):
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    pieces = tokens[: sum(sizes)].split(sizes)  # rows past the last group: none of them
    return torch.cat([p @ weight[e].t().to(p.dtype) for e, p in enumerate(pieces)])


def aligned_groups(tokens, sorted_experts, counts, align: int):
    """Tokens sorted by expert laid out with each expert's rows padded to a multiple of
    `align` (zero rows), as torchtitan pads them for FP8 grouped GEMMs (torch's 2d x 2d
    weight-gradient GEMM asserts on group sizes that are not 16 bytes): (the padded rows,
    their group end offsets int32, each token's padded row). A static number of rows (the
    most any counts need): no host sync."""
    rows = tokens.shape[0]
    padded = (counts + align - 1) // align * align
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(rows, device=tokens.device) - starts[sorted_experts]
    dest = (padded_ends - padded)[sorted_experts] + rank
    bound = -(-(rows + counts.shape[0] * (align - 1)) // align) * align  # aligned in all
    laid_out = tokens.new_zeros(bound, tokens.shape[1]).index_copy(0, dest, tokens)
    return laid_out, padded_ends.to(torch.int32), dest


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, topk: int, ffn: int) -> None:
        super().__init__()
        self.experts_n, self.topk = experts, topk
        self.align = 1  # 16 under torchao's FP8 grouped GEMMs (convert_torchao_experts)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        top_logits, top_experts = logits.topk(self.topk, dim=-1)
        probs = top_logits.softmax(dim=-1)  # softmax over the top-k: renormalized
        flat_experts = top_experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        # A scatter-add, not bincount (whose output shape is data-dependent to the compiler).
        counts = torch.zeros(self.experts_n, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        offsets = counts.cumsum(0).to(torch.int32)
        tokens = x[order // self.topk]
        if self.align > 1:
            sorted_experts = flat_experts[order]
            laid_out, offsets, dest = aligned_groups(tokens, sorted_experts, counts, self.align)
            out = self.experts(laid_out, offsets)[dest]
        else:
            out = self.experts(tokens, offsets)
        weighted = out * probs.reshape(-1)[order, None].to(out.dtype)
        combined = torch.zeros_like(x).index_add_(0, order // self.topk, weighted)
        return combined.reshape(shape)


class Layer(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention = Attention(hidden, args.num_attention_heads, args.num_query_groups)
        self.moe = MoE(hidden, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoEGPT(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = nn.RMSNorm(args.hidden_size)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.loss = mean_cross_entropy  # compiled with --compile, as our rows' loss is

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(inputs)
        for layer in self.layers:
            x = layer(x)
        return self.loss(self.head(self.norm(x)), labels)


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean token loss in fp32 (the logits upcast first)."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, object]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = MoEGPT(args).to(device)
    init_weights(model)
    if args.torchao_fp8_rowwise:
        convert_torchao_experts(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        if args.compile:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    if args.compile:
        model.loss = torch.compile(model.loss)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, weight_decay=0.01, fused=device.type == "cuda"
    )
    return model, optimizer


def convert_torchao_experts(model: nn.Module) -> None:
    """torchao's float8 rowwise grouped GEMMs on the experts' weights (torchtitan's way)."""
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except ImportError as error:
        raise SystemExit(f"--torchao-fp8-rowwise needs torchao ({error})") from None
    quantize_(
        model, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: isinstance(module, Experts)
    )
    for module in model.modules():
        if isinstance(module, MoE):
            module.align = TORCHAO_GROUP_ALIGN


TORCHAO_GROUP_ALIGN = 16
"""Rows per expert group under torchao's float8 grouped GEMMs (torchtitan's alignment for
FP8: 16 one-byte elements along the weight gradient's token dimension)."""


def accumulate(model, batches) -> None:
    """Gradients of the mean loss over equal micro-batches [(inputs, labels), ...], one
    backward each (FSDP2 reduces them after the last)."""
    for index, (inputs, labels) in enumerate(batches):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(index == len(batches) - 1)
        (model(inputs, labels) / len(batches)).backward()


def step(model, optimizer, batches) -> None:
    optimizer.zero_grad(set_to_none=True)
    accumulate(model, batches)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, optimizer = build(args, device)
    generator = torch.Generator().manual_seed(dist.get_rank())
    shape = (args.global_batch_size, args.seq_length + 1)
    tokens = torch.randint(0, args.vocab_size, shape, generator=generator).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens.split(args.micro_batch_size)]
    times_ms = []
    for index in range(args.warmup_steps + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, optimizer, batches)
        if cuda:
            torch.cuda.synchronize()
        if index >= args.warmup_steps:
            times_ms.append((time.perf_counter() - start) * 1e3)
    step_ms = statistics.median(times_ms)
    result = {
        "engine": "fsdp2",
        "model": "moe_peer",
        "torchao_fp8_rowwise": args.torchao_fp8_rowwise,
        "compile": args.compile,
        "world_size": dist.get_world_size(),
        "step_ms": round(step_ms, 3),
        "global_batch_size": args.global_batch_size,
        "tokens_per_s_per_gpu": round(args.global_batch_size * args.seq_length / step_ms * 1e3, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
    }
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
