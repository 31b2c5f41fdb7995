"""Which layers are MoE, and the MoE settings that cannot be built, each refused with a
ValueError naming the Megatron-LM flag and the fix."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
DISPATCHER_TYPES = ("allgather", "alltoall")


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """For each layer (0-based), whether its MLP is an MoE layer (`--moe-layer-freq`)."""
    if config.num_moe_experts is None:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq {freq} must be >= 1 (1 makes every layer MoE)")
        return [index % freq == 0 for index in range(config.num_layers)]
    if len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
        raise ValueError(
            f"--moe-layer-freq {freq} must list one 0 (dense) or 1 (MoE) per layer, "
            f"{config.num_layers} in all, e.g. ([0]*1+[1]*{config.num_layers - 1})"
        )
    return [flag == 1 for flag in freq]


def _check_router(config: TransformerConfig) -> None:
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if not 1 <= topk <= experts:
        raise ValueError(f"--moe-router-topk {topk} must be in 1..--num-experts ({experts})")
    if config.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ValueError(
            f"--moe-router-score-function {config.moe_router_score_function!r} is not built; "
            "use softmax or sigmoid"
        )
    if config.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        raise ValueError(
            f"--moe-router-load-balancing-type {config.moe_router_load_balancing_type!r} is not "
            f"built; use one of {', '.join(LOAD_BALANCING_TYPES)}"
        )
    if config.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ValueError(f"--moe-router-dtype {config.moe_router_dtype!r}; use fp32 or fp64")
    if (
        topk == 1
        and config.moe_router_score_function == "softmax"
        and not config.moe_router_pre_softmax
        and config.moe_router_load_balancing_type != "sinkhorn"
    ):
        raise ValueError(
            "--moe-router-topk 1 with softmax scores gives the router a zero gradient; "
            "add --moe-router-pre-softmax"
        )
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"
        )
    if config.moe_router_load_balancing_type == "sinkhorn" and config.moe_aux_loss_coeff != 0:
        raise ValueError(
            "--moe-router-load-balancing-type sinkhorn takes no aux loss; set "
            "--moe-aux-loss-coeff 0"
        )
    _check_group_limited(config)


def _check_group_limited(config: TransformerConfig) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if group_topk is None:
        return
    if groups is None or config.num_moe_experts % groups:
        raise ValueError(
            f"--moe-router-group-topk needs --moe-router-num-groups dividing --num-experts "
            f"({config.num_moe_experts}); got {groups}"
        )
    if not 1 <= group_topk <= groups or config.moe_router_topk % group_topk:
        raise ValueError(
            f"--moe-router-group-topk {group_topk} must be in 1..--moe-router-num-groups "
            f"({groups}) and divide --moe-router-topk ({config.moe_router_topk})"
        )
    if config.moe_router_topk > group_topk * (config.num_moe_experts // groups):
        raise ValueError(
            f"--moe-router-topk {config.moe_router_topk} exceeds the experts in "
            f"--moe-router-group-topk {group_topk} groups; raise the group top-k"
        )


def _check_capacity(config: TransformerConfig) -> None:
    factor = config.moe_expert_capacity_factor
    if config.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(
            f"--moe-token-drop-policy {config.moe_token_drop_policy!r}; use probs or position"
        )
    if factor is not None and config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError(
            "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss or none load "
            "balancing; change --moe-router-load-balancing-type"
        )
    if factor is not None and factor <= 0:
        raise ValueError(
            f"--moe-expert-capacity-factor {factor} must be > 0; leave it unset for dropless"
        )
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


def check_moe_config(config: TransformerConfig) -> None:
    """Raise ValueError naming the flag and the fix for MoE settings that cannot be built."""
    experts = config.num_moe_experts
    ep_size = config.expert_model_parallel_size
    if experts is None:
        if ep_size != 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
        return
    if experts < 1 or ep_size < 1 or experts % ep_size:
        raise ValueError(
            f"--num-experts {experts} must be a positive multiple of "
            f"--expert-model-parallel-size {ep_size}"
        )
    if config.add_bias_linear:
        raise ValueError("biases in the MoE experts are not built; add --disable-bias-linear")
    if config.moe_token_dispatcher_type not in DISPATCHER_TYPES:
        raise ValueError(
            f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type!r} is not built; "
            "use alltoall or allgather"
        )
    size = config.moe_shared_expert_intermediate_size
    if size is not None and size <= 0:
        raise ValueError(f"--moe-shared-expert-intermediate-size {size} must be > 0")
    _check_router(config)
    _check_capacity(config)
    moe_layer_pattern(config)
