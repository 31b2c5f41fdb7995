"""mcore_reference.py at tensor-parallel size 2: megatron-core (0.16.1, its own venv) on two
CPU gloo ranks, launched by the venv's torchrun, never with this repository on the path.

    torchrun --nproc-per-node 2 mcore_reference_tp.py save --variant V --out DIR
    torchrun --nproc-per-node 2 mcore_reference_tp.py load --ckpt C --tokens T --out L
(torchrun: the venv's `python -m torch.distributed.run`)

`save` builds the model with `initialize_model_parallel(2, 1)` (each rank its TP shards of the
same CPU-initialized master weights), saves it collectively as Megatron-LM's training does
(args.tensor_model_parallel_size = 2) and writes, from rank 0, the tokens and the full logits
(the vocab-parallel logits all-gathered over TP). `load` builds the TP 2 model and loads a
checkpoint into it (megatron-core reslices the full tensors), then writes its full logits.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_reference as reference  # noqa: E402

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402

TP = 2


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel logits [B, S, V / TP] of every TP rank, concatenated."""
    local = reference.logits(model, tokens).contiguous()
    pieces = [torch.empty_like(local) for _ in range(TP)]
    dist.all_gather(pieces, local, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def save(variant: str, out: str) -> None:
    args = reference.megatron_args(variant)
    args.tensor_model_parallel_size = TP
    torch.manual_seed(0)
    model = reference.build_model(args)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape))
    ckpt = os.path.join(out, "ckpt")
    directory = os.path.join(ckpt, f"iter_{reference.ITERATION:07d}")
    os.makedirs(directory, exist_ok=True)
    state = {
        "model": model.sharded_state_dict(),
        "args": args,
        "iteration": reference.ITERATION,
        "checkpoint_version": 3.0,
    }
    dist_checkpointing.save(state, directory)
    tokens = torch.randint(0, args.padded_vocab_size, (2, args.seq_length))
    result = full_logits(model, tokens)
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(reference.ITERATION))
        torch.save(tokens, os.path.join(out, "tokens.pt"))
        torch.save(result, os.path.join(out, "logits.pt"))


def load(ckpt: str, tokens_path: str, out: str) -> None:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as handle:
        tag = handle.read().strip()
    directory = os.path.join(ckpt, "release" if tag == "release" else f"iter_{int(tag):07d}")
    args = dist_checkpointing.load_common_state_dict(directory)["args"]
    model = reference.build_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"], strict=True)
    result = full_logits(model, torch.load(tokens_path))
    if dist.get_rank() == 0:
        torch.save(result, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("--variant", choices=sorted(reference.VARIANTS), default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt")
    parser.add_argument("--tokens")
    cli = parser.parse_args()
    reference._cpu_shims()
    dist.init_process_group("gloo")  # torchrun's env: two ranks
    parallel_state.initialize_model_parallel(TP, 1)
    if cli.mode == "save":
        save(cli.variant, cli.out)
    else:
        load(cli.ckpt, cli.tokens, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
