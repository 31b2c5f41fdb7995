"""Flat-tensor collectives that work on NCCL (GPU) and gloo (CPU) across torch 2.11 - 2.13.

Both backends accept the flat "into tensor" all-gather and reduce-scatter for uint8, bf16 and
fp32 (checked on torch 2.13 gloo). torch 2.13 renamed `reduce_scatter_tensor` and
`all_gather_into_tensor` to `*_single` and deprecates the old names; 2.11 only has the old
ones. FP8 tensors are rejected by gloo, so FP8 bytes travel as uint8 (what buffers hold).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None)
if _reduce_scatter_single is None:
    _reduce_scatter_single = dist.reduce_scatter_tensor
# Same rename for the flat all-gather (torch 2.13: all_gather_single).
_all_gather_single = getattr(dist, "all_gather_single", None)
if _all_gather_single is None:
    _all_gather_single = dist.all_gather_into_tensor


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """output[r * n : (r + 1) * n] = rank r's `shard` (n = shard.numel())."""
    if dist.get_world_size(group) == 1:
        output.copy_(shard)
        return None
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """output = sum over ranks of full[r * n : (r + 1) * n] for this rank r."""
    if dist.get_world_size(group) == 1:
        output.copy_(full)
        return None
    return _reduce_scatter_single(
        output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def all_reduce_sum(
    tensor: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class CommStats:
    """Bytes this rank's collectives produce or consume, since the last reset.

    Definitions (per rank, logical payload; on a ring each rank actually sends and receives
    (W-1)/W of it, W the size of the group the collective runs on):
    - all_gather_bytes: size of every all-gather's gathered output (W x shard bytes).
    - reduce_scatter_bytes: size of every reduce-scatter's full input (W x shard bytes).
    - all_reduce_bytes: size of every all-reduced buffer (no_shard grads).
    These three count the shard group only: the whole DP group under plain ZeRO, the inner
    (intra-node) group under HSDP. With an outer (replica) group, always reported:
    - outer_all_reduce_bytes: grad shards all-reduced across replicas (outer no_shard).
    - outer_reduce_scatter_bytes / outer_all_gather_bytes: the padded grad shard
      reduce-scattered, and the fp32 main shard all-gathered, across replicas (outer optim).
    Reported only when non-zero (FP8 parameters):
    - fp8_all_gather_bytes: the part of all_gather_bytes that is FP8 bytes plus their scales.
    - amax_all_reduce_bytes: the packed MAX all-reduce of weight amaxes after a step.
    """

    KEYS = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")
    OUTER_KEYS = ("outer_all_reduce_bytes", "outer_reduce_scatter_bytes", "outer_all_gather_bytes")
    OPTIONAL_KEYS = ("fp8_all_gather_bytes", "amax_all_reduce_bytes")

    def __init__(self, *, outer: bool = False) -> None:
        self.reported = self.KEYS + (self.OUTER_KEYS if outer else ())
        self.reset()

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.KEYS + self.OUTER_KEYS + self.OPTIONAL_KEYS, 0)

    def add(self, key: str, nbytes: int) -> None:
        self.counts[key] += nbytes

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.counts.items() if k in self.reported or v}
