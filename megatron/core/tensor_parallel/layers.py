"""Tensor-parallel layers with Megatron-LM's semantics, on a group passed in.

- `ColumnParallelLinear`: rank r holds output rows r of each block of the full weight; its
  input is replicated (or, with sequence parallelism, gathered from sequence shards).
- `RowParallelLinear`: rank r holds input columns r; the partial outputs are summed over the
  group (or reduce-scattered to sequence shards); the bias is added once, after the sum.
- `VocabParallelEmbedding`: rank r holds vocabulary rows [r V/tp, (r+1) V/tp).

Each layer can cut its shard out of the full (TP = 1) tensor with `shard_of_full`, so that a
model initialized from full tensors equals the TP = 1 model exactly. These layers compute in
high precision; their FP8 twins (FP8 weights and GEMMs, the sequence-parallel gather in FP8)
are in `tensor_parallel.fp8`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.dist_checkpointing.tp_placement import TensorParallelPlacement, TensorSplit
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    count_collective,
    gather_from_tensor_parallel_region,
    linear_with_sequence_gather,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group and whether activations between the parallel regions are
    sequence shards (`--sequence-parallel`)."""

    group: dist.ProcessGroup
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


SEQUENCE_PARALLEL_ATTR = "sequence_parallel"
"""Attribute set (True) on a parameter replicated over TP that sees only this rank's sequence
shard: its gradient is partial and must be all-reduced over TP (see
`all_reduce_sequence_parallel_grads`)."""


def mark_sequence_parallel_(param: nn.Parameter) -> None:
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by --tensor-model-parallel-size {denominator}; "
            f"pick a tensor-parallel size dividing {numerator}"
        )
    return numerator // denominator


def shard_blocks(
    full: torch.Tensor, blocks: Sequence[int], dim: int, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """Split `full` along `dim` into `blocks`, cut each block into `tp_size` equal pieces and
    concatenate piece `tp_rank` of every block: [q | k | v] -> [q_r | k_r | v_r]."""
    pieces = [block.chunk(tp_size, dim=dim)[tp_rank] for block in full.split(list(blocks), dim)]
    return torch.cat(pieces, dim=dim).contiguous()


def _new_param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype))


class TensorParallelModule(nn.Module):
    """A layer whose parameters are split over `self.tp` (`tensor_parallel_shards` finds them
    by this base): it defines `shard_of_full(name, full)` and `full_shape(name)`."""

    tp: TensorParallel


def column_blocks(out_features: int, output_blocks: Sequence[int] | None, tp_size: int) -> tuple:
    """The fused output widths of a column-parallel Linear (default: one block), each split over
    TP so that every rank holds matching pieces; refused where a width does not divide."""
    blocks = tuple(output_blocks or (out_features,))
    if sum(blocks) != out_features:
        raise ValueError(f"output_blocks {blocks} must sum to {out_features}")
    for index, width in enumerate(blocks):
        divide(width, tp_size, f"output block {index} width")
    return blocks


class ColumnSplit(TensorParallelModule):
    """How a column-parallel Linear's [full_out_features, in_features] weight (and bias) is cut
    over TP: by rows, block by block of `output_blocks`."""

    output_blocks: tuple[int, ...]
    full_out_features: int

    def shard_of_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor of parameter `name` ("weight" or "bias")."""
        return shard_blocks(full, self.output_blocks, 0, self.tp.size, self.tp.rank)

    def full_shape(self, name: str) -> tuple[int, ...]:
        out = self.full_out_features
        return (out, self.in_features) if name == "weight" else (out,)

    def checkpoint_split(self, name: str) -> TensorSplit:
        """How parameter `name` is cut from the full tensor: by rows, block by block."""
        return TensorSplit(0, self.output_blocks, self.full_shape(name))


class RowSplit(TensorParallelModule):
    """How a row-parallel Linear's [out_features, full_in_features] weight is cut over TP: by
    input columns. The bias is replicated (added after the sum), so only the weight is split."""

    full_in_features: int
    split_parameters = ("weight",)

    def shard_of_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp.size, dim=1)[self.tp.rank].contiguous()

    def full_shape(self, name: str) -> tuple[int, ...]:
        full_in = self.full_in_features
        return (self.out_features, full_in) if name == "weight" else (self.out_features,)

    def checkpoint_split(self, name: str) -> TensorSplit:
        return TensorSplit(1, (self.full_in_features,), self.full_shape(name))


class ColumnParallelLinear(ColumnSplit):
    """y = x W^T + b with W's output rows split over TP; y holds this rank's rows.

    `output_blocks` (default: one block) lists the widths of the fused outputs, e.g.
    [q, k, v] widths or [gate, up]: each block is split over TP so that every rank holds
    matching pieces. `gather_output` all-gathers y (one block only).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tensor_parallel: TensorParallel,
        output_blocks: Sequence[int] | None = None,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tensor_parallel
        self.output_blocks = column_blocks(out_features, output_blocks, self.tp.size)
        if gather_output and len(self.output_blocks) > 1:
            raise ValueError("gather_output needs a single output block")
        self.in_features, self.out_features = in_features, out_features
        self.full_out_features = out_features
        self.gather_output = gather_output
        local_out = out_features // self.tp.size
        self.weight = _new_param((local_out, in_features), dtype)
        self.bias = _new_param((local_out,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_matmul(x, self.weight, self.tp)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp.group)
        return y


class RowParallelLinear(RowSplit):
    """y = sum over ranks of x_r W_r^T, plus b: W's input columns are split over TP and `x`
    is this rank's slice of the input's last dimension (a column-parallel output)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tensor_parallel: TensorParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tensor_parallel
        self.in_features, self.out_features = in_features, out_features
        self.full_in_features = in_features
        local_in = divide(in_features, self.tp.size, "row-parallel input width")
        self.weight = _new_param((out_features, local_in), dtype)
        self.bias = _new_param((out_features,), dtype) if bias else None
        if self.bias is not None and self.tp.sequence_parallel:
            mark_sequence_parallel_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding whose rows (the vocabulary) are split over TP. Each rank looks up the ids in
    its range, zeroes the others, and the rows are summed over the group, so every rank gets
    the full [B, S, D] (replicated)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tensor_parallel: TensorParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tensor_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = divide(num_embeddings, self.tp.size, "vocabulary size (padded)")
        self.vocab_start = self.tp.rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = _new_param((local, embedding_dim), dtype)

    def shard_of_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.vocab_start : self.vocab_end].clone()

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    def checkpoint_split(self, name: str) -> TensorSplit:
        return TensorSplit(0, (self.num_embeddings,), self.full_shape(name))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(rows, self.tp.group)


TENSOR_PARALLEL_MODULES = (TensorParallelModule,)


def tensor_parallel_shards(model: nn.Module) -> dict[str, nn.Module]:
    """{parameter name: owning TP module} for every parameter split over TP (a row-parallel
    bias is replicated: not listed), so that an initializer draws the full tensor
    (`full_shape`) and keeps `shard_of_full`, and a grad norm counts each shard once."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, TENSOR_PARALLEL_MODULES):
            for name, _ in module.named_parameters(recurse=False):
                if name in getattr(module, "split_parameters", (name,)):
                    found[f"{prefix}.{name}" if prefix else name] = module
    return found


def tensor_parallel_placement(
    model: nn.Module, tensor_parallel: TensorParallel
) -> TensorParallelPlacement:
    """Where this rank's TP shards lie in a checkpoint's full tensors (by parameter name)."""
    splits = {
        name: owner.checkpoint_split(name.rsplit(".", 1)[-1])
        for name, owner in tensor_parallel_shards(model).items()
    }
    return TensorParallelPlacement(splits, tensor_parallel.rank, tensor_parallel.size)


def all_reduce_sequence_parallel_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum over TP the gradients of parameters marked sequence-parallel (norms and
    row-parallel biases under --sequence-parallel), as Megatron-LM's finalize_model_grads."""
    for param in model.parameters():
        if getattr(param, SEQUENCE_PARALLEL_ATTR, False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            count_collective("all_reduce", param.grad)


@dataclass(frozen=True)
class TensorParallelGrads:
    """What a grad finalization owes tensor parallelism, by parameter name, for engines whose
    grads live away from `param.grad` (Megatron-FSDP's sharded buffers): the grads that are
    partial sums over TP (sequence-parallel replicated params), and the parameters this rank
    counts in the grad norm (its TP shards, plus the replicated ones on TP rank 0, as
    Megatron-LM's clip_grad_norm), whose squares then sum over TP."""

    group: dist.ProcessGroup
    partial_names: frozenset[str]
    counted_names: frozenset[str]

    @classmethod
    def of_model(cls, model: nn.Module, tensor_parallel: TensorParallel) -> TensorParallelGrads:
        names = [name for name, _ in model.named_parameters()]
        params = dict(model.named_parameters())
        partial = {n for n in names if getattr(params[n], SEQUENCE_PARALLEL_ATTR, False)}
        counted = set(names) if tensor_parallel.rank == 0 else set(tensor_parallel_shards(model))
        return cls(tensor_parallel.group, frozenset(partial), frozenset(counted))

    def sum_over_group(self, value: float, device: torch.device) -> float:
        """`value` summed over the TP ranks, in fp64 (a norm's square, a zero count)."""
        total = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.group)
        return total.item()

    def norm_over_group(self, local_norm: float, device: torch.device) -> float:
        """The L2 norm over TP of the ranks' norms of disjoint pieces (NaN stays NaN)."""
        total = self.sum_over_group(local_norm * local_norm, device)
        return math.sqrt(total) if math.isfinite(total) else float("nan")

    def sum_partial_grads_(self, grads: Sequence[torch.Tensor]) -> None:
        """All-reduce over TP, in one collective, the grads of `partial_names` params given
        in the same order on every TP rank (each rank's buffer layout is the same)."""
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.group)
        count_collective("all_reduce", flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def column_parallel_matmul(
    x: torch.Tensor, weight: torch.Tensor, tensor_parallel: TensorParallel
) -> torch.Tensor:
    """Logits [B, S, V/tp] of this rank's vocabulary rows `weight` [V/tp, D] (the output
    layer's shard or the tied embedding's); `x` is replicated, or a sequence shard under
    sequence parallelism (gathered here)."""
    if tensor_parallel.sequence_parallel:  # only the shard is kept for backward
        return linear_with_sequence_gather(x, weight, tensor_parallel.group)
    return F.linear(copy_to_tensor_parallel_region(x, tensor_parallel.group), weight)


def mark_replicated_sequence_parallel_(model: nn.Module, *, skip_prefixes: tuple[str, ...]):
    """Mark as sequence-parallel every parameter of `model` that no TP layer owns and whose
    name starts with none of `skip_prefixes` (parameters used before the scatter to sequence
    shards, e.g. a position table): norms see only sequence shards under
    --sequence-parallel, so their gradients are partial."""
    owned = tensor_parallel_shards(model)
    for name, param in model.named_parameters():
        if name not in owned and not name.startswith(skip_prefixes):
            mark_sequence_parallel_(param)
