"""Which parameters get grads in a compiled FP8-parameter step, against eager (GPU).

Builds a small GPTModel under Megatron-FSDP (ZeRO-3) with FP8 parameters, as
benchmarks/bench_gpt.py does, once eager and once with each layer's forward compiled, runs one
forward and backward on the same tokens and prints each parameter's grad norm (from the
engine's grad shards) side by side. A parameter whose compiled grad norm is 0 lost its grad.
'compiled': the layers compiled as training compiles them (prepare_for_compile: FP8
parameters enter the graph as stand-ins); 'unprepared': compiled without prepare_for_compile
(FP8-parameter Linears then run outside the graph, `compile.forward_outside_the_graph`).

    python3 dev/probe_compile_grads.py --fp8-recipe tensorwise
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.linear import apply_fp8_setup
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.transformer_config import TransformerConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grad_norms(recipe: str, *, compiled: bool, prepared: bool = True) -> dict:
    config = TransformerConfig(
        fp8=Fp8Config(recipe=recipe, fp8_param_gather=True),
        num_layers=2,
        hidden_size=512,
        ffn_hidden_size=1024,
        num_attention_heads=4,
        vocab_size=1024,
        max_sequence_length=256,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=True,
        params_dtype=torch.bfloat16,
    )
    torch._dynamo.reset()
    with torch.device("meta"):
        model = GPTModel(config)
    apply_fp8_setup(model, fp8_config=config.fp8, amax_reduction_group=dist.group.WORLD)
    if compiled:
        for layer in model.decoder.layers:
            if prepared:
                prepare_for_compile(layer)
            layer.forward = torch.compile(layer.forward)
    model = FullyShardedDataParallel(
        model,
        fsdp_config=FsdpConfig(
            data_parallel_sharding_strategy="optim_grads_params", init_model_with_meta_device=True
        ),
        device=DEVICE,
        init_fn=lambda name, t: init_parameter_(t, name=name, config=config, seed=0),
        fp8_config=config.fp8,
    )
    optimizer = model.build_optimizer(OptimizerConfig(lr=1e-5, clip_grad=0.0))
    tokens = torch.randint(0, 1024, (2, 257), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    model.zero_grad_buffer()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    with torch.autograd.set_multithreading_enabled(False):  # as pretrain_gpt.py runs it
        loss.backward()
    model.finish_grad_sync()
    norms = {}
    for piece in optimizer.pieces:
        norms[piece.name] = norms.get(piece.name, 0.0) + float(piece.grad_view().norm()) ** 2
    return {name: value**0.5 for name, value in norms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8-recipe", default="tensorwise")  # delayed|blockwise|mxfp8 too
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", rank=0, world_size=1)
    eager = grad_norms(args.fp8_recipe, compiled=False)
    compiled = grad_norms(args.fp8_recipe, compiled=True)
    unprepared = grad_norms(args.fp8_recipe, compiled=True, prepared=False)
    print(f"{args.fp8_recipe}: grad norms (module docstring: the columns)")
    print(f"{'parameter':52s} {'eager':>10s} {'compiled':>10s} {'unprepared':>10s}")
    for name in eager:
        print(f"{name:52s} {eager[name]:10.5f} {compiled[name]:10.5f} {unprepared[name]:10.5f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
