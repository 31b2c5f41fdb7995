"""Reference side of the Megatron-LM interchange test: runs under megatron-core (0.16.1), in its
own venv, never with this repository on the path (its `megatron` would shadow megatron-core's).

    python mcore_reference.py save --variant llama --out DIR
        builds a tiny megatron-core GPTModel (local layer spec, CPU), saves it as Megatron-LM's
        training does (`dist_checkpointing.save` of {"model": sharded_state_dict, args,
        iteration, checkpoint_version} into DIR/ckpt/iter_0000007 plus the tracker file), and
        writes DIR/tokens.pt and DIR/logits.pt;
    python mcore_reference.py load --ckpt CKPT --tokens T --out LOGITS
        builds the GPTModel from the checkpoint's saved args, loads it with
        `dist_checkpointing.load(model.sharded_state_dict(), ...)` and writes its logits.

Variants: `llama` (RMSNorm, SwiGLU, RoPE base 5000, GQA 4 heads / 2 groups, head width 24, no
biases, untied head) and `gpt` (LayerNorm, GeLU, learned positions, biases, tied head).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

if os.path.isdir(os.path.join(os.getcwd(), "megatron", "training")):
    sys.exit("run from a directory without this repository's megatron/ (e.g. cd /tmp)")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

ITERATION = 7
VARIANTS = {
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=5000,
        add_bias_linear=False,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=24,
        untie_embeddings_and_output_weights=True,
        ffn_hidden_size=80,
    ),
    "gpt": dict(
        normalization="LayerNorm",
        swiglu=False,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        add_bias_linear=True,
        group_query_attention=False,
        num_query_groups=4,
        kv_channels=16,
        untie_embeddings_and_output_weights=False,
        ffn_hidden_size=256,
    ),
}


def _cpu_shims() -> None:
    """megatron-core's torch_dist writer and attention assume CUDA; on CPU-only torch these
    stand-ins take the calls' places (none of them touches a tensor value)."""
    torch.cuda.synchronize = lambda *args, **kwargs: None  # after D2H copies: none on CPU
    torch.cuda.current_device = lambda: "cpu"  # device of the save's failure flag (gloo)
    # The attention dropout's CUDA RNG fork: dropout is 0 and the model is in eval mode.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        import psutil  # noqa: F401 - the writer logs its memory with it
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0


def megatron_args(variant: str) -> argparse.Namespace:
    """The subset of Megatron-LM's args a GPT checkpoint records, with its names."""
    shape = VARIANTS[variant]
    return argparse.Namespace(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        max_position_embeddings=32,
        padded_vocab_size=96,
        vocab_size=90,
        norm_epsilon=1e-6,
        rotary_percent=1.0,
        rotary_interleaved=False,
        apply_layernorm_1p=False,
        qk_layernorm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_format="torch_dist",
        transformer_impl="local",
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        add_qkv_bias=shape["add_bias_linear"],
        attention_backend=AttnBackend.auto,
        **shape,
    )


def build_model(args: argparse.Namespace) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    ).eval()


@torch.no_grad()
def logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    causal = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()  # True: masked out
    return model(tokens, positions, attention_mask=causal)


def save(variant: str, out: str) -> None:
    args = megatron_args(variant)
    torch.manual_seed(0)
    model = build_model(args)
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a swapped norm or bias
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape))
    ckpt = os.path.join(out, "ckpt")
    directory = os.path.join(ckpt, f"iter_{ITERATION:07d}")
    os.makedirs(directory)
    state = {
        "model": model.sharded_state_dict(),
        "args": args,
        "iteration": ITERATION,
        "checkpoint_version": 3.0,
    }
    dist_checkpointing.save(state, directory)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(ITERATION))
    tokens = torch.randint(0, args.padded_vocab_size, (2, args.seq_length))
    torch.save(tokens, os.path.join(out, "tokens.pt"))
    torch.save(logits(model, tokens), os.path.join(out, "logits.pt"))


def load(ckpt: str, tokens_path: str, out: str) -> None:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
        tag = handle.read().strip()
    directory = os.path.join(ckpt, "release" if tag == "release" else f"iter_{int(tag):07d}")
    args = dist_checkpointing.load_common_state_dict(directory)["args"]
    model = build_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"], strict=True)
    torch.save(logits(model, torch.load(tokens_path)), out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt")
    parser.add_argument("--tokens")
    cli = parser.parse_args()
    _cpu_shims()
    # Megatron-LM's setup at world size 1: a gloo group, model parallel sizes 1.
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    parallel_state.initialize_model_parallel(1, 1)
    if cli.mode == "save":
        save(cli.variant, cli.out)
    else:
        load(cli.ckpt, cli.tokens, cli.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
