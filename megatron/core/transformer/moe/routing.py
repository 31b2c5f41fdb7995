"""Routing math of Megatron-LM's top-k router as plain functions on [tokens, experts]
tensors: scores, top-k (optionally group-limited), the load-balancing losses, z-loss,
sinkhorn and expert capacity. The router module (router.py) strings them together."""

from __future__ import annotations

import math

import torch

# Added to the sum of the chosen sigmoid scores before normalizing, as Megatron-LM does, so
# that k scores that all underflow to 0 give 0 instead of NaN.
SIGMOID_NORM_EPS = 1e-20
# Sinkhorn: stop when the mean change of the column scaling falls below this (Megatron-LM's
# default), and keep each denominator away from 0.
SINKHORN_TOL = 1e-4
SINKHORN_EPS = 1e-8


def group_limited_topk(
    scores: torch.Tensor, *, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the experts of each token's best `group_topk` groups (DeepSeek-V3).

    Experts split into `num_groups` equal consecutive groups; a group's score is the sum of
    its best topk / group_topk expert scores. Returns (values, indices), each [tokens, topk].
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, chosen_groups, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_groups, dim=1)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1)


def _topk(
    scores: torch.Tensor, *, topk: int, num_groups: int | None, group_topk: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        return group_limited_topk(scores, topk=topk, num_groups=num_groups, group_topk=group_topk)
    return scores.topk(topk, dim=1)


def topk_routing(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] zero off the chosen experts, routing_map [T, E] bool) from logits [T, E].

    softmax: over all experts then top-k (pre_softmax), or top-k logits then softmax over
    those k. sigmoid: top-k of sigmoid(logits) (+ expert_bias for the choice only), then the k
    scores normalized to sum 1 when k > 1. Scores are fp32; probs return in the logits' dtype.
    """
    groups = dict(topk=topk, num_groups=num_groups, group_topk=group_topk)
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _topk(torch.softmax(logits, dim=-1, dtype=torch.float32), **groups)
        else:
            chosen, indices = _topk(logits, **groups)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, indices = _topk(scores + expert_bias.float(), **groups)
            probs = scores.gather(1, indices)
        else:
            probs, indices = _topk(scores, **groups)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    else:
        raise ValueError(f"score_function {score_function!r}; use softmax or sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def scores_for_aux_loss(
    logits: torch.Tensor, *, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map [T, E], scores [T, E] fp32) the load-balancing losses see: softmax, or
    sigmoid normalized over all experts; the map is their plain top-k (no bias, no groups)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_map, scores


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    num_tokens: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i with f_i = tokens_i / (T k), P_i = mean score of expert i
    (Switch Transformer; Megatron-LM's aux_loss). scores [T, E], tokens_per_expert [E]."""
    num_experts = scores.shape[-1]
    weighted = torch.sum(scores.sum(dim=0) * tokens_per_expert)
    return weighted * (num_experts * coeff / (topk * num_tokens * num_tokens))


def aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, *, topk: int, coeff: float
) -> torch.Tensor:
    """Megatron-LM's aux_loss over this rank's [T, E] tokens."""
    return switch_load_balancing_loss(
        scores, routing_map.sum(dim=0), num_tokens=scores.shape[0], topk=topk, coeff=coeff
    )


def seq_aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, *, batch: int, topk: int, coeff: float
) -> torch.Tensor:
    """Megatron-LM's seq_aux_loss: the aux loss of each sequence alone, averaged over the
    batch. Tokens are batch-major ([B*S, E] from [B, S, E])."""
    num_experts = scores.shape[-1]
    seq_length = scores.shape[0] // batch
    per_seq_scores = scores.view(batch, seq_length, num_experts).sum(dim=1)
    per_seq_counts = routing_map.view(batch, seq_length, num_experts).sum(dim=1)
    weighted = torch.sum(per_seq_scores * per_seq_counts)
    return weighted * (num_experts * coeff / (topk * seq_length * seq_length)) / batch


def z_loss(logits: torch.Tensor, *, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: coeff * mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost: torch.Tensor) -> torch.Tensor:
    """Doubly-normalized exp(cost) [T, E] by Sinkhorn iterations (Megatron-LM's routing)."""
    cost = torch.exp(cost)
    row_scale = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    col_scale = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    previous = col_scale
    error = math.inf
    while error > SINKHORN_TOL:
        row_scale = (1 / row_scale.numel()) / (torch.sum(col_scale * cost, 1) + SINKHORN_EPS)
        col_scale = (1 / col_scale.numel()) / (
            torch.sum(row_scale.unsqueeze(1) * cost, 0) + SINKHORN_EPS
        )
        error = torch.mean(torch.abs(previous - col_scale)).item()
        previous = col_scale
    return col_scale * cost * row_scale.unsqueeze(1)


def expert_capacity(*, num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """ceil(T * k / E * factor): tokens one expert takes at most."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    topk: int,
    capacity_factor: float,
    drop_policy: str,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) with each expert keeping at most `capacity` tokens: those of highest
    probability (probs) or the earliest routed ones (position). With pad_to_capacity every
    expert gets exactly `capacity` tokens, padding ones having probability 0."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(
        num_tokens=num_tokens, topk=topk, num_experts=num_experts, factor=capacity_factor
    )
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        kept = probs.topk(capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    elif drop_policy == "position":
        # Rank each token within its expert's column by position: routed tokens first, in
        # token order, then the unrouted ones (the padding candidates), in token order.
        order = torch.arange(num_tokens, device=probs.device).unsqueeze(1)
        rank_key = order + num_tokens * (~routing_map).long()
        kept = rank_key.topk(capacity, dim=0, largest=False, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    else:
        raise ValueError(f"drop_policy {drop_policy!r}; use probs or position")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map
