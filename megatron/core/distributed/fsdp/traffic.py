"""Bytes a Megatron-FSDP step moves, from formulas: what CommStats counts, and per link class.

`counter_bytes` predicts `FullyShardedDataParallel.comm_stats()` of one training step under
ZeRO-3 (optim_grads_params), plain or HSDP; the tests check it against the counters measured on
gloo, and docs/SCALING.md (tools/scaling_table.py) builds its tables from it. Per rank, M
micro-batches, S shard ranks, N replicas, every unit padded to a multiple of S:

    all_gather_bytes      = M * (root + 2 * sum(layers)) * gather bytes   (layers: fwd + bwd)
    reduce_scatter_bytes  = M * (root + sum(layers)) * reduce bytes
    outer no_shard:  outer_all_reduce_bytes     = shard * reduce bytes     (once per step)
    outer optim:     outer_reduce_scatter_bytes = shard' * reduce bytes    (shard' = shard padded
                     outer_all_gather_bytes     = shard' * 4 (fp32 main)    to N parts)

`wire_bytes` turns those logical sizes into what one GPU sends on a ring: (W-1)/W of an
all-gather's output or a reduce-scatter's input, 2 (W-1)/W of an all-reduced buffer, on
NVLink when the group lies inside a node and on the network when it spans nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its elements and the bytes per element its all-gather moves."""

    numel: int
    gather_bytes: float
    """Per element gathered: 4 fp32, 2 bf16, 1 FP8 (plus scales: 2/32 for mxfp8's two
    directions); a unit mixing FP8 weights and bf16 norms uses its weighted mean."""


def _padded(numel: int, parts: int) -> int:
    return -(-numel // parts) * parts


def counter_bytes(
    root: Unit,
    layers: Sequence[Unit],
    *,
    shard_size: int,
    outer_size: int = 1,
    outer_strategy: str = "no_shard",
    micro_batches: int = 1,
    reduce_bytes: float = 4,
    main_bytes: float = 4,
) -> dict[str, int]:
    """comm_stats() of one ZeRO-3 step (keys as CommStats reports them). A shard group of one
    rank runs no inner collective: it holds every unit whole (no gathers), and its grads need
    no reduce-scatter (the counters count collectives that ran)."""
    units = [root, *layers]
    padded = [_padded(unit.numel, shard_size) for unit in units]
    gather = padded[0] * root.gather_bytes + 2 * sum(
        n * unit.gather_bytes for n, unit in zip(padded[1:], layers)
    )
    inner = 1 if shard_size > 1 else 0
    stats = {
        "all_gather_bytes": round(inner * micro_batches * gather),
        "reduce_scatter_bytes": round(inner * micro_batches * sum(padded) * reduce_bytes),
        "all_reduce_bytes": 0,
    }
    if outer_size == 1:
        return stats
    shards = [n // shard_size for n in padded]
    outer_optim = outer_strategy == "optim"
    split = sum(_padded(n, outer_size) for n in shards)
    stats["outer_all_reduce_bytes"] = 0 if outer_optim else round(sum(shards) * reduce_bytes)
    stats["outer_reduce_scatter_bytes"] = round(split * reduce_bytes) if outer_optim else 0
    stats["outer_all_gather_bytes"] = round(split * main_bytes) if outer_optim else 0
    return stats


def wire_bytes(
    stats: dict[str, int], *, shard_size: int, outer_size: int, gpus_per_node: int
) -> dict[str, float]:
    """Bytes one GPU sends per step on each link class ('nvlink', 'network')."""
    inner = (shard_size - 1) / shard_size
    inner_bytes = inner * (stats["all_gather_bytes"] + stats["reduce_scatter_bytes"])
    inner_link = "nvlink" if shard_size <= gpus_per_node else "network"
    outer = (outer_size - 1) / outer_size
    outer_bytes = outer * (
        2 * stats.get("outer_all_reduce_bytes", 0)
        + stats.get("outer_reduce_scatter_bytes", 0)
        + stats.get("outer_all_gather_bytes", 0)
    )
    result = {"nvlink": 0.0, "network": 0.0}
    result[inner_link] += inner_bytes
    result["network"] += outer_bytes  # replicas of a node-sized shard group: other nodes
    return result


def state_bytes_per_gpu(
    numel: int, *, shard_size: int, outer_size: int, outer_strategy: str, fp8_numel: int = 0
) -> float:
    """Persistent bytes per GPU under ZeRO-3 with bf16 compute: fp32 main params and grads
    (4 + 4, over the shard group), Adam moments (8, also over the replicas with outer optim),
    and the FP8 bytes of FP8 weights (1); bf16 compute values are cast at gather time."""
    optimizer_split = shard_size * (outer_size if outer_strategy == "optim" else 1)
    return (8 * numel + fp8_numel) / shard_size + 8 * numel / optimizer_split
