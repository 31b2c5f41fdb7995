"""The autograd collectives of tensor and sequence parallelism (Megatron-LM's semantics).

Each function is the forward of a pair whose backward is its conjugate:

| function | forward | backward |
|---|---|---|
| copy_to_tensor_parallel_region | identity | all-reduce |
| reduce_from_tensor_parallel_region | all-reduce | identity |
| scatter_to_tensor_parallel_region | keep this rank's last-dim slice | all-gather last dim |
| gather_from_tensor_parallel_region | all-gather last dim | keep this rank's slice |
| scatter_to_sequence_parallel_region | keep this rank's sequence slice | all-gather sequence |
| gather_from_sequence_parallel_region | all-gather sequence | reduce-scatter sequence |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter sequence | all-gather sequence |
| linear_with_sequence_gather | all-gather sequence, GEMM | all-gather again, reduce-scatter |

Tensors are batch-first [B, S, ...], so the sequence dimension is 1 (Megatron-LM's is 0,
[S, B, H]); rank r of the group holds slice r of a split dimension (rank order of the group).

Every tensor-parallel collective that a process runs eagerly is counted by kind in logical bytes,
the size of the full tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's
tensor): `tensor_parallel_bytes()` (compiled regions run the same collectives uncounted);
`megatron.core.tensor_parallel.traffic` has the formulas the tests check against these
counters (docs/SCALING.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE_DIM = 1
"""The dimension that sequence parallelism splits: tensors are [B, S, D]."""

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_BYTES = dict.fromkeys(COLLECTIVE_KINDS, 0)


def count_collective(kind: str, full: torch.Tensor) -> None:
    """Add one collective of `kind` over the full tensor `full` to this process's counters.
    Eager code only: inside a torch.compile trace the count would run once per compile, and a
    global dict mutated there is a graph break (and a guard on its value, a recompile per
    step), so compiled regions are not counted (the collectives they run are the same)."""
    if torch.compiler.is_compiling():
        return
    _BYTES[kind] += full.numel() * full.element_size()


def tensor_parallel_bytes() -> dict[str, int]:
    """This process's tensor-parallel collectives since the last reset: logical bytes by kind."""
    return dict(_BYTES)


def reset_tensor_parallel_bytes() -> None:
    for kind in COLLECTIVE_KINDS:
        _BYTES[kind] = 0


def _world(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _check_divisible(size: int, world: int, dim: int) -> None:
    if size % world:
        raise ValueError(
            f"dimension {dim} of size {size} does not split over {world} tensor-parallel "
            "ranks; pick sizes divisible by --tensor-model-parallel-size"
        )


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim`."""
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x.shape[dim], world, dim)
    rank = dist.get_rank(group)
    return x.chunk(world, dim=dim)[rank].contiguous()


def _gather(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, count: bool = True
) -> torch.Tensor:
    """The slices of all ranks concatenated along `dim` in rank order (count: in the TP byte
    counters)."""
    return _start_gather(x, dim, group, count=count, overlap=False)()


def _start_gather(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, count: bool = True, overlap: bool
) -> Callable[[], torch.Tensor]:
    """Start `_gather` (asynchronously with `overlap`); the function returned waits for it and
    returns the full tensor."""
    world = _world(group)
    if world == 1:
        return lambda: x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(world)]
    work = dist.all_gather(pieces, x, group=group, async_op=overlap)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        full = torch.cat(pieces, dim=dim)
        if count:
            count_collective("all_gather", full)
        return full

    return finish


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, kind: str = "all_reduce"):
    """The sum over ranks (a new tensor), counted as `kind`."""
    if _world(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    count_collective(kind, x)
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of `x`, of which this rank keeps its slice along `dim`."""
    return _start_reduce_scatter(x, dim, group, overlap=False)()


def _start_reduce_scatter(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, overlap: bool
) -> Callable[[], torch.Tensor]:
    """Start `_reduce_scatter` (asynchronously with `overlap`); the function returned waits for
    it and returns this rank's slice of the sum."""
    world = _world(group)
    if world == 1:
        return lambda: x
    _check_divisible(x.shape[dim], world, dim)
    if dist.get_backend(group) == dist.Backend.GLOO:
        # gloo has no reduce-scatter: the all-reduce's sum is the same, one slice is kept (CPU
        # runs: nothing to overlap).
        total = _all_reduce(x, group, kind="reduce_scatter")
        return lambda: _split(total, dim, group)
    inputs = [piece.contiguous() for piece in x.chunk(world, dim=dim)]
    out = torch.empty_like(inputs[0])
    work = dist.reduce_scatter(out, inputs, group=group, async_op=overlap)
    count_collective("reduce_scatter", x)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        return out

    return finish


class _LinearWithSequenceGather(torch.autograd.Function):
    """x W^T of the sequence-gathered x, keeping only this rank's shard of x for backward (as
    Megatron-LM's column-parallel Linear under sequence parallelism): backward gathers it again
    for the weight gradient, behind the input gradient's GEMM, and reduce-scatters the input
    gradient behind the weight gradient's GEMM (in eager code)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, SEQUENCE_DIM, group), weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        overlap = not torch.compiler.is_compiling()  # a compiled graph orders its collectives
        gathering = _start_gather(x, SEQUENCE_DIM, ctx.group, overlap=overlap) if need_w else None
        scattering = None
        if need_x:
            scattering = _start_reduce_scatter(
                grad.matmul(weight), SEQUENCE_DIM, ctx.group, overlap=overlap
            )
        grad_w = None
        if need_w:
            full = gathering()
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        return (scattering() if need_x else None), grad_w, None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherAlong(torch.autograd.Function):
    """All-gather along `dim`; backward keeps this rank's slice of the gradient, or, when the
    consumer's gradient is partial on each rank (a tensor-parallel GEMM follows), the slice of
    the sum over ranks (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim, group, grad_is_partial):
        ctx.dim, ctx.group, ctx.grad_is_partial = dim, group, grad_is_partial
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced over `group` (the input of a
    column-parallel Linear, replicated on every rank)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduce forward (the partial sums of a row-parallel Linear); identity backward."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered."""
    return _ScatterAlong.apply(x, -1, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather the last dimension in rank order; the gradient keeps this rank's slice."""
    return _GatherAlong.apply(x, -1, group, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's sequence slice of a replicated [B, S, ...]; the gradient is
    all-gathered along the sequence."""
    return _ScatterAlong.apply(x, SEQUENCE_DIM, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup, *, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence shards [B, S/tp, ...] into [B, S, ...]. Backward reduce-scatters
    (the consumer is a column-parallel GEMM whose input gradient is a partial sum), or with
    `grad_is_partial=False` keeps this rank's slice."""
    return _GatherAlong.apply(x, SEQUENCE_DIM, group, grad_is_partial)


def linear_with_sequence_gather(
    x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The column-parallel GEMM under sequence parallelism: x [B, S/tp, D] gathered along the
    sequence, times weight [N, D]^T; backward gathers x again (only the shard is kept) and
    reduce-scatters the input gradient."""
    return _LinearWithSequenceGather.apply(x, weight, group)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Sum the partial [B, S, ...] of a row-parallel GEMM over ranks, keeping this rank's
    sequence slice; the gradient is all-gathered along the sequence."""
    return _ReduceScatterAlong.apply(x, SEQUENCE_DIM, group)
