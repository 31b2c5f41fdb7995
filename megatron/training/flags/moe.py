"""Mixture-of-Experts flags (Megatron-LM core_v0.19.0's names and defaults), their parse-time
checks and their TransformerConfig fields.

The rules of what an MoE config may be live once, in
megatron/core/transformer/moe/config_checks.py (check_moe_config); here they run on the config
the flags make, so a bad command line exits 2 with that one line. The checks that need the
world size (the expert-parallel size must divide it) are here. Parse-time code on the Namespace.
"""

from __future__ import annotations

import argparse
import ast

import torch

from megatron.core.fp8.config import Fp8Config
from megatron.core.transformer.moe.grouped_fp8 import grouped_path_applies

# TransformerConfig field -> flag attribute (dest) holding its value.
MOE_CONFIG_FIELDS = {
    "num_moe_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_layer_freq": "moe_layer_freq",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_router_topk": "moe_router_topk",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_group_topk": "moe_router_group_topk",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_dtype": "moe_router_dtype",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_token_drop_policy": "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
    "moe_permute_fusion": "moe_permute_fusion",
    "expert_model_parallel_size": "expert_model_parallel_size",
}

PERMUTE_FUSION_NOTE = (
    "--moe-permute-fusion: accepted; the token permutation here is one index gather and the "
    "combine one gather-and-sum per token under dropless top-k, an index_add otherwise "
    "(megatron/core/transformer/moe/token_dispatcher.py; compiled by default on CUDA), the "
    "values of Megatron-LM's fused permute kernels, so there is nothing further to fuse."
)
GROUPED_GEMM_NOTE = (
    "--moe-grouped-gemm: the routed experts always keep one stacked weight here, run as one "
    "grouped GEMM in bf16 on CUDA and under every FP8 recipe (emulated on CPU; mxfp8 where "
    "each expert's output dim is a multiple of 32); other cases loop over the experts."
)
# Why a recipe's experts loop where moe/grouped_fp8.grouped_path_applies (the rule) says so.
PER_EXPERT_FP8_WHY = {"mxfp8": "a 32x1 mxfp8 cell would span two experts"}


def _layer_freq_node(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_layer_freq_node(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _layer_freq_node(node.left), _layer_freq_node(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(node)


def moe_layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq: an int (every N-th layer is MoE) or a Python list expression of 0/1
    such as ([0]*1+[1]*3), as Megatron-LM's parser reads it (here without eval)."""
    try:  # Megatron-LM reads a text without "[" as int(text): "1+1" is no pattern
        if "[" not in text:
            return int(text)
        value = _layer_freq_node(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an int nor a list pattern such as ([0]*1+[1]*3)"
        ) from None
    return value


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Mixture of Experts (Megatron-LM's flags)")
    add = group.add_argument
    add("--num-experts", type=int, default=None, help="Routed experts per MoE layer.")
    add("--moe-ffn-hidden-size", type=int, default=None, help="Expert width (--ffn-hidden-size).")
    add(
        "--moe-layer-freq",
        type=moe_layer_freq,
        default=1,
        help="Every N-th layer is MoE (N int), or a 0/1 list per layer, e.g. ([0]*1+[1]*3).",
    )
    add(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Width of the shared experts run on every token (None: no shared experts).",
    )
    add("--moe-shared-expert-gate", action="store_true", help="Sigmoid gate on shared experts.")
    add("--moe-grouped-gemm", action="store_true", help="Accepted; experts are always grouped.")
    add("--moe-router-topk", type=int, default=2, help="Experts per token.")
    add(
        "--moe-router-score-function",
        choices=("softmax", "sigmoid"),
        default="softmax",
        help="Router score function.",
    )
    add("--moe-router-pre-softmax", action="store_true", help="Softmax before the top-k.")
    add("--moe-router-num-groups", type=int, default=None, help="Groups for group-limited top-k.")
    add("--moe-router-group-topk", type=int, default=None, help="Groups each token may use.")
    add(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="Multiplier of the chosen experts' probabilities.",
    )
    add("--moe-router-dtype", choices=("fp32", "fp64"), default=None, help="Router GEMM dtype.")
    add(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="Aux-loss-free balancing: a per-expert bias updated after each step (sigmoid).",
    )
    add("--moe-router-bias-update-rate", type=float, default=1e-3, help="Expert-bias step.")
    add(
        "--moe-router-load-balancing-type",
        nargs="+",
        default="aux_loss",
        help="aux_loss, seq_aux_loss, sinkhorn or none (one type here).",
    )
    add(
        "--moe-aux-loss-coeff",
        type=float,
        nargs="+",
        default=0.0,
        help="Load-balancing loss coefficient (one value here).",
    )
    add("--moe-z-loss-coeff", type=float, default=None, help="Router z-loss coefficient.")
    _add_capacity_and_dispatch(group)


def _add_capacity_and_dispatch(group) -> None:
    add = group.add_argument
    add(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="Expert capacity factor (None: dropless).",
    )
    add(
        "--moe-token-drop-policy",
        choices=("probs", "position"),
        default="probs",
        help="Which tokens an expert over capacity drops.",
    )
    add(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="Pad every expert's input to its capacity.",
    )
    add(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
        default="allgather",
        help="Token dispatch over the expert-parallel ranks (flex/DeepEP is not built).",
    )
    add("--moe-permute-fusion", action="store_true", help="Accepted; see the log note.")
    add(
        "--moe-per-layer-logging",
        action="store_true",
        help="Each MoE layer's aux losses to TensorBoard/W&B (moe/<name>_layer_<i>).",
    )
    add(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Ranks the routed experts are split over, inside the data-parallel ranks.",
    )


def _single(value, flag: str):
    """The one value of a Megatron-LM nargs='+' flag (Megatron-LM allows one per type)."""
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise ValueError(
            f"{flag} {' '.join(map(str, value))}: several load-balancing types at once are not "
            "built here; give one"
        )
    return value[0]


def moe_config_values(args: argparse.Namespace) -> dict[str, object]:
    """TransformerConfig's MoE fields from the flags. Raises ValueError naming the flag."""
    values = {field: getattr(args, dest) for field, dest in MOE_CONFIG_FIELDS.items()}
    values["moe_router_load_balancing_type"] = _single(
        args.moe_router_load_balancing_type, "--moe-router-load-balancing-type"
    )
    values["moe_aux_loss_coeff"] = float(_single(args.moe_aux_loss_coeff, "--moe-aux-loss-coeff"))
    return values


def validate_moe_world(args: argparse.Namespace) -> None:
    """The checks that need the world size: EP splits the data-parallel ranks (under HSDP the
    ranks of one replica)."""
    ep_size, world = args.expert_model_parallel_size, args.data_parallel_size
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} must divide the data-parallel size "
            f"({world} ranks); use a divisor of it"
        )
    instances = args.num_distributed_optimizer_instances
    if instances > 1 and world % instances == 0 and (world // instances) % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} must divide the ranks of one HSDP replica "
            f"({world // instances} = {world} / --num-distributed-optimizer-instances "
            f"{instances}); use a divisor of it"
        )


def moe_notes(args: argparse.Namespace) -> list[str]:
    """Log notes for accepted MoE flags that change nothing here, and for an FP8 recipe whose
    experts loop (args with the FP8 defaults resolved)."""
    notes = []
    if args.moe_permute_fusion:
        notes.append(PERMUTE_FUSION_NOTE)
    if args.moe_grouped_gemm:
        notes.append(GROUPED_GEMM_NOTE)
    if args.num_experts is not None and args.fp8_recipe is not None:
        notes += _looping_experts_note(args)
    return notes


def _looping_experts_note(args: argparse.Namespace) -> list[str]:
    """The note for experts that loop under the FP8 recipe at these shapes, asked of the rule
    itself for each expert Linear's stacked [experts, out, in] weight (TransformerConfig's
    widths: the expert width defaults to the FFN width, 4 x hidden by default)."""
    recipe = args.fp8_recipe
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size or 4 * args.hidden_size
    widths = {"fc1": ffn * (2 if args.swiglu else 1), "fc2": args.hidden_size}
    config = Fp8Config(recipe=recipe)
    looping = [
        f"{name} (output dim {out})"
        for name, out in widths.items()
        if not grouped_path_applies(config, torch.empty(1, out, 1, device="meta"))
    ]
    if not looping:
        return []
    why = PER_EXPERT_FP8_WHY.get(recipe, "no grouped path is built for it")
    return [
        f"FP8 recipe {recipe} with --num-experts: the routed experts' {' and '.join(looping)} "
        f"run one FP8 GEMM per expert here ({why}), not one grouped GEMM. That costs host "
        "time: ~0.9 s a step on M-small's 64 experts x 2 Linears x 8 layers, ~9x its bf16 "
        "step on an H100 (docs/PERFORMANCE.md, session 43); an output dim that is a multiple "
        "of 32 groups them."
    ]


def unbuilt_moe_features(args: argparse.Namespace) -> list[str]:
    """The MoE combinations not built, as written with what to use instead (for the one
    exit-2 "not built" message, megatron_lm.unbuilt_features)."""
    found = []
    tp_size = args.tensor_model_parallel_size
    if args.num_experts is not None and tp_size != 1:
        found.append(
            f"--tensor-model-parallel-size {tp_size} with --num-experts (MoE with tensor "
            "parallelism; use --tensor-model-parallel-size 1)"
        )
    ep_size = args.expert_model_parallel_size
    if ep_size == 1:
        return found
    if args.use_torch_fsdp2:
        found.append(
            f"--expert-model-parallel-size {ep_size} with --use-torch-fsdp2 (use "
            "--use-megatron-fsdp or DDP)"
        )
    if args.ckpt_format == "torch" and (args.save is not None or args.load is not None):
        found.append(
            f"--ckpt-format torch with --expert-model-parallel-size {ep_size} (one file set of "
            "full tensors on rank 0; use --ckpt-format torch_dist, the default with EP)"
        )
    return found
