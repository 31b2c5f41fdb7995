"""--tensor-model-parallel-size and --sequence-parallel at parse time: the flags, and the layout
checks that name the fix (issue 40, acceptance 6). Raises ValueError, shown as one `error:`
line (exit 2)."""

from __future__ import annotations

import argparse

from megatron.core.fp8.recipe import recipe_spec
from megatron.core.transformer.transformer_config import resolved_shape


def add_tensor_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallelism (Megatron-LM's flags)")
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Ranks that split each layer (consecutive ranks; data parallelism over the rest).",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Norms and residuals on sequence shards between the tensor-parallel regions; at "
        "tensor-parallel size 1 it is off, as in Megatron-LM.",
    )


def vocab_padding_multiple(args: argparse.Namespace) -> int:
    """The embedding rows are padded to a multiple of --make-vocab-size-divisible-by x TP, as
    Megatron-LM does, so every tensor-parallel rank holds as many vocabulary rows."""
    return args.make_vocab_size_divisible_by * args.tensor_model_parallel_size


def validate_tensor_parallel_args(args: argparse.Namespace) -> None:
    """The layout checks of --tensor-model-parallel-size (resolved flags)."""
    tp = args.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp} must be at least 1.")
    if tp == 1:
        return
    if args.world_size % tp:
        raise ValueError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size "
            f"{tp}; launch a multiple of {tp} ranks (--nproc-per-node) or pick a size dividing "
            f"{args.world_size}."
        )
    if args.num_attention_heads < 1 or args.hidden_size < 1:
        return  # the model checks name these
    shape = resolved_shape(
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
    )
    sizes = (
        ("--num-attention-heads", args.num_attention_heads),
        ("--num-query-groups", shape["num_query_groups"]),
        ("--ffn-hidden-size", shape["ffn_hidden_size"]),
    )
    if args.padded_vocab_size is not None:  # --use-checkpoint-args: the checkpoint's rows
        sizes += (("the checkpoint's vocabulary rows", args.padded_vocab_size),)
    for flag, size in sizes:
        if size % tp:
            raise ValueError(
                f"{flag} {size} is not divisible by --tensor-model-parallel-size {tp}; pick a "
                f"tensor-parallel size dividing {size}."
            )
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(
            f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{tp} with --sequence-parallel; pick a sequence length that is a multiple of {tp} "
            "or leave out --sequence-parallel."
        )
    _refuse_not_built_with_tensor_parallel(args)
    if args.fp8_recipe is not None:
        _check_fp8_with_tensor_parallel(args, shape)


def _refuse_not_built_with_tensor_parallel(args: argparse.Namespace) -> None:
    not_built = [
        (args.use_torch_fsdp2, "--use-torch-fsdp2", "Megatron-FSDP or torch DDP"),
        (
            args.ckpt_format == "torch" and (args.save is not None or args.load is not None),
            "--ckpt-format torch (one file set of one rank's shards)",
            "--ckpt-format torch_dist, which holds the full tensors",
        ),
        (args.multi_latent_attention, "--multi-latent-attention", "GQA"),
        (args.qk_layernorm, "--qk-layernorm", "no QK norm"),
        (args.mtp_num_layers, "--mtp-num-layers", "next-token loss only"),
    ]
    found = [f"{what} (use {instead})" for given, what, instead in not_built if given]
    if found:
        raise ValueError(
            "--tensor-model-parallel-size > 1 is not built yet with: "
            + "; ".join(found)
            + ". Tensor parallelism runs with torch DDP or Megatron-FSDP (every strategy, "
            "HSDP) over the data-parallel ranks."
        )


def _check_fp8_with_tensor_parallel(args: argparse.Namespace, shape: dict) -> None:
    """FP8 across TP (docs/FP8_NUMERICS.md): block and MX cells must not straddle a TP cut,
    and a tensorwise weight's scale is agreed over TP only by Megatron-FSDP's FP8 weights."""
    tp = args.tensor_model_parallel_size
    spec = recipe_spec(args.fp8_recipe)
    kv_channels = shape["kv_channels"]
    pieces = {
        "--num-attention-heads x kv-channels / TP": args.num_attention_heads * kv_channels // tp,
        "--num-query-groups x kv-channels / TP": shape["num_query_groups"] * kv_channels // tp,
        "--ffn-hidden-size / TP": shape["ffn_hidden_size"] // tp,
    }
    cut = check_fp8_tensor_parallel_split(spec.block, pieces)
    if cut is not None:
        raise ValueError(
            f"--fp8-recipe {spec.name} with --tensor-model-parallel-size {tp}: {cut} is not a "
            f"multiple of the {spec.block}-wide scale blocks, so a block would straddle two "
            "tensor-parallel ranks; pick sizes whose per-rank pieces are multiples of "
            f"{spec.block}, a smaller TP size, or --fp8-recipe tensorwise/delayed."
        )
    if spec.accepts_global_amax and not (args.use_megatron_fsdp and args.fp8_param_gather):
        raise ValueError(
            "--fp8-recipe tensorwise with --tensor-model-parallel-size > 1 needs FP8 weights "
            "whose scale is agreed over TP: add --use-megatron-fsdp --fp8-param-gather, or use "
            "--fp8-recipe delayed/blockwise/mxfp8."
        )


def check_fp8_tensor_parallel_split(block: int, pieces: dict[str, int]) -> str | None:
    """The first per-rank piece (description -> width) that is not a whole number of
    `block`-wide scale cells (128x128 weights and 1x128 activations of blockwise, 1x32 of
    mxfp8), as 'description width'; None when every TP cut falls on a cell edge. Per-tensor
    recipes (block 0) never straddle."""
    for name, width in pieces.items():
        if block and width % block:
            return f"{name} = {width}"
    return None
