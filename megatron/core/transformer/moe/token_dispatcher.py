"""Token dispatch: group tokens by expert, carry them to the expert-parallel rank that holds
their expert, run the experts, bring the outputs back and combine them with the routing probs.

Rank r of an expert-parallel group of size P holds global experts [r L, (r + 1) L), L = E / P.
The group is passed in (no global process groups); P = 1 runs everything locally. The
routing probabilities are applied when combining (sum over a token's experts of p * expert(x)),
so only hidden states travel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

ExpertsFn = Callable[[torch.Tensor, list[int] | torch.Tensor, list[list[int]] | None], torch.Tensor]
"""experts(tokens sorted by expert, tokens per expert (a list, or the counts on the device when
each expert is one segment), each expert's segments by source or None)."""


def permute(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    per_token: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, H] sorted by expert then token, their probs [N], their token indices [N],
    tokens per expert [E]) for routing_map [T, E]; N = routing_map.sum(). With `per_token`
    (every token chose that many experts) the tokens' gradient is each token's rows' sum
    gathered token by token (`_Replicate`), not scattered back with atomic adds."""
    permuted_probs, token_indices, counts, by_token = _permutation(probs, routing_map, per_token)
    return _gather_tokens(hidden, token_indices, by_token), permuted_probs, token_indices, counts


def _permutation(probs, routing_map, per_token):
    """`permute`'s probs, token indices and counts, and with per_token each token's rows
    (`token_major`, built once for the gather's gradient and the combine), else None."""
    counts = routing_map.t().sum(dim=1)
    if per_token is not None:
        permuted_probs, token_indices, by_token = _dropless_permutation(
            probs, routing_map, counts, per_token
        )
        return permuted_probs, token_indices, counts, by_token
    positions = routing_map.t().reshape(-1).nonzero().squeeze(1)  # e * T + t, ascending
    token_indices = positions % routing_map.shape[0]
    permuted_probs = probs.t().reshape(-1)[positions]
    return permuted_probs, token_indices, counts, None


def _dropless_permutation(probs, routing_map, counts, per_token):
    """Dropless top-k (every token chose exactly per_token experts): (probs, token indices,
    each token's rows [T, per_token]) of the rows sorted by expert then token, with no sort
    and no data-dependent shape (a compiled graph holds them). Token t's row for its expert e
    is e's first row plus the tokens before t that chose e; a token's experts are taken in
    ascending order, so its rows ascend (the order `token_major` gives)."""
    tokens = routing_map.shape[0]
    taken = routing_map.to(torch.int64)
    # A token's j-th expert (ascending) is where its running count of choices reaches j + 1.
    nth = torch.arange(1, per_token + 1, device=routing_map.device).expand(tokens, per_token)
    chosen = torch.searchsorted(taken.cumsum(dim=1), nth.contiguous())
    before = taken.cumsum(dim=0) - taken  # [T, E]: tokens before t that chose e
    row_of = (counts.cumsum(0) - counts).unsqueeze(0) + before
    by_token = row_of.gather(1, chosen)  # [T, per_token], ascending per token
    rows = by_token.flatten()
    token = torch.arange(tokens, device=routing_map.device).repeat_interleave(per_token)
    token_indices = torch.empty_like(rows).scatter_(0, rows, token)
    row_probs = probs.gather(1, chosen).flatten()
    permuted_probs = torch.empty_like(row_probs).scatter_(0, rows, row_probs)
    return permuted_probs, token_indices, by_token


def _gather_tokens(hidden, token_indices, by_token):
    """hidden[token_indices]; with by_token its gradient gathered token by token."""
    if by_token is None:
        return hidden[token_indices]
    return _Replicate.apply(hidden, token_indices, by_token)


def token_major(token_indices: torch.Tensor, per_token: int) -> torch.Tensor:
    """[T, per_token]: the rows of each token among rows whose tokens are `token_indices`
    (every token exactly per_token times), in row order."""
    return token_indices.argsort(stable=True).view(-1, per_token)


def _sum_per_token(rows: torch.Tensor, by_token: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's rows (`token_major`) summed in fp32 (or rows' wider dtype),
    rounded once to rows' dtype."""
    picked = rows[by_token.flatten()].view(*by_token.shape, rows.shape[-1])
    return picked.sum(dim=1, dtype=torch.promote_types(rows.dtype, torch.float32)).to(rows.dtype)


class _Replicate(torch.autograd.Function):
    """rows[j] = hidden[token_indices[j]], every token per_token times; backward sums each
    token's row grads by gathering them (no atomic scatter into [T, H])."""

    @staticmethod
    def forward(ctx, hidden, token_indices, by_token):
        ctx.save_for_backward(by_token)
        return hidden[token_indices]

    @staticmethod
    def backward(ctx, grad_rows):
        (by_token,) = ctx.saved_tensors
        return _sum_per_token(grad_rows, by_token), None, None


class _SumPerToken(torch.autograd.Function):
    """The combine of rows whose tokens are `token_indices` (every token per_token times):
    [T, H] sums gathered token by token; backward gathers each row's token's grad."""

    @staticmethod
    def forward(ctx, rows, token_indices, by_token):
        ctx.save_for_backward(token_indices)
        return _sum_per_token(rows, by_token)

    @staticmethod
    def backward(ctx, grad_tokens):
        (token_indices,) = ctx.saved_tensors
        return grad_tokens[token_indices], None, None


def unpermute(
    expert_output: torch.Tensor,
    permuted_probs: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    num_tokens: int,
    per_token: int | None = None,
) -> torch.Tensor:
    """[T, H]: each token's sum over its experts of prob * expert output. per_token (every
    token chose that many experts, its rows all here): summed token by token in fp32 and
    rounded once (`_SumPerToken`); otherwise added into [T, H] row by row (index_add)."""
    by_token = None if per_token is None else token_major(token_indices, per_token)
    return _combine(expert_output, permuted_probs, token_indices, by_token, num_tokens)


def _combine(expert_output, permuted_probs, token_indices, by_token, num_tokens):
    """`unpermute` with each token's rows (`token_major`) given, or None (index_add)."""
    weighted = expert_output * permuted_probs.to(expert_output.dtype).unsqueeze(-1)
    if by_token is not None:
        return _SumPerToken.apply(weighted, token_indices, by_token)
    combined = expert_output.new_zeros(num_tokens, expert_output.shape[-1])
    return combined.index_add(0, token_indices, weighted)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the grads back the other way."""

    @staticmethod
    def forward(ctx, tokens, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        output = tokens.new_empty(sum(output_splits), *tokens.shape[1:])
        dist.all_to_all_single(
            output, tokens.contiguous(), output_splits, input_splits, group=group
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        grad = grad_output.new_empty(sum(input_splits), *grad_output.shape[1:])
        dist.all_to_all_single(
            grad, grad_output.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return grad, None, None, None


def _reorder_chunks(tokens: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    chunks = tokens.split(sizes, dim=0)
    return torch.cat([chunks[index] for index in order], dim=0)


def alltoall_dispatch_combine(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    experts: ExpertsFn,
    group: dist.ProcessGroup | None,
    sources: int = 1,
    per_token: int | None = None,
) -> torch.Tensor:
    """The alltoall dispatcher: [T, H] tokens of this rank -> [T, H] combined expert outputs.
    sources (no group only): the tokens are that many equal source-rank blocks (the
    allgather dispatcher's), which are the experts' segments. per_token: `permute`'s."""
    num_tokens = hidden.shape[0]
    permuted_probs, token_indices, counts, by_token = _permutation(probs, routing_map, per_token)
    permuted = _gather_tokens(hidden, token_indices, by_token)
    combine = (permuted_probs, token_indices, by_token, num_tokens)
    ep_size = 1 if group is None else dist.get_world_size(group)
    if ep_size == 1:
        if sources == 1:  # one segment per expert: the counts may stay on the device
            expert_output = experts(permuted, counts, None)
        else:
            by_source = routing_map.reshape(sources, -1, routing_map.shape[-1]).sum(dim=1)
            expert_output = experts(permuted, counts.tolist(), by_source.t().tolist())
        return _combine(expert_output, *combine)
    counts_by_rank = counts.view(ep_size, -1)
    received_counts = torch.empty_like(counts_by_rank)
    dist.all_to_all_single(received_counts, counts_by_rank, group=group)
    input_splits = counts_by_rank.sum(dim=1).tolist()
    output_splits = received_counts.sum(dim=1).tolist()
    received = _AllToAll.apply(permuted, output_splits, input_splits, group)
    # Received tokens come source rank by source rank, each sorted by local expert; the
    # experts want them local expert by local expert.
    num_local = received_counts.shape[1]
    rank_major_sizes = received_counts.flatten().tolist()
    to_expert_major = [
        rank * num_local + local for local in range(num_local) for rank in range(ep_size)
    ]
    by_expert = _reorder_chunks(received, rank_major_sizes, to_expert_major)
    segments = received_counts.t().tolist()
    expert_output = experts(by_expert, received_counts.sum(dim=0).tolist(), segments)
    expert_major_sizes = received_counts.t().flatten().tolist()
    to_rank_major = [
        local * ep_size + rank for rank in range(ep_size) for local in range(num_local)
    ]
    by_rank = _reorder_chunks(expert_output, expert_major_sizes, to_rank_major)
    returned = _AllToAll.apply(by_rank, input_splits, output_splits, group)
    return _combine(returned, *combine)


class _GatherFromGroup(torch.autograd.Function):
    """Concatenate every rank's equal-sized tensor along dim 0; backward sums the grads over
    the ranks and keeps this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _gather_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _sum_and_keep_own_rows(grad_output, ctx.group), None


class _ReduceScatterToGroup(torch.autograd.Function):
    """Sum over the ranks, keep this rank's rows; backward all-gathers the grads."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _sum_and_keep_own_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_rows(grad_output, ctx.group), None


def _gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=0)


def _sum_and_keep_own_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # all_reduce then slice: gloo has no reduce_scatter, and this path is for small groups.
    total = tensor.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()


def allgather_dispatch_combine(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    experts: ExpertsFn,
    group: dist.ProcessGroup | None,
    per_token: int | None = None,
) -> torch.Tensor:
    """The allgather dispatcher: every rank gathers all ranks' tokens and routing, runs its
    local experts on the tokens routed to them, and the partial outputs are summed back to
    the tokens' ranks. Needs the same token count on every rank. per_token: `permute`'s (a
    rank's slice of the experts sees any count per token)."""
    ep_size = 1 if group is None else dist.get_world_size(group)
    if ep_size == 1:
        return alltoall_dispatch_combine(
            hidden, probs, routing_map, experts=experts, group=None, per_token=per_token
        )
    all_hidden = _GatherFromGroup.apply(hidden, group)
    all_probs = _GatherFromGroup.apply(probs, group)
    # As bytes: gloo does not gather bool tensors.
    all_map = _gather_rows(routing_map.to(torch.uint8), group).bool()
    num_local = routing_map.shape[1] // ep_size
    first = dist.get_rank(group) * num_local
    local = slice(first, first + num_local)
    partial = alltoall_dispatch_combine(
        all_hidden,
        all_probs[:, local],
        all_map[:, local],
        experts=experts,
        group=None,
        sources=ep_size,
    )
    return _ReduceScatterToGroup.apply(partial, group)
