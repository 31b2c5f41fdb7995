"""Bytes a GPT step moves over the tensor-parallel group, per rank: the formulas that
`mappings.tensor_parallel_bytes()` counts (tests/unit_tests/tensor_parallel/test_tp_traffic.py)
and docs/SCALING.md projects.

Per micro-batch of B sequences of S tokens, A = B * S * hidden * activation bytes (one full
activation), L layers (each: one column-parallel QKV and FC1, one row-parallel projection and
FC2):
- without sequence parallelism, all-reduces of A: the embedding's sum (forward), each row-parallel
  output (forward), each column-parallel input's gradient (backward), the output layer's input
  gradient (backward): A (2 + 4 L);
- with sequence parallelism, every one of those per-layer all-reduces becomes an all-gather and
  a reduce-scatter of A (forward: gather before each column-parallel GEMM, reduce-scatter after
  each row-parallel one; backward the conjugates), the embedding keeps its all-reduce and its
  sequence split adds an all-gather of the gradient, the output layer gathers its input
  (reduce-scatter of the gradient); each column-parallel GEMM (QKV, FC1, the output layer)
  keeps only its input's shard and gathers it again in backward for its weight gradient, as
  Megatron-LM does: all-reduce A, all-gather A (6 L + 3), reduce-scatter A (4 L + 1);
- the vocab-parallel cross-entropy: three all-reduces of B * S fp32 values (forward);
- once per step with sequence parallelism: the gradients of the parameters that see only the
  sequence shard (norms, row-parallel biases) all-reduced over TP.
Counts are logical bytes (the full tensor); `wire_bytes` gives what a ring sends per rank.
"""

from __future__ import annotations

LOSS_BYTES = 4
"""The cross-entropy's all-reduced values are fp32."""


def micro_batch_bytes(
    *,
    num_layers: int,
    hidden_size: int,
    micro_batch: int,
    seq_length: int,
    activation_bytes: int,
    sequence_parallel: bool,
) -> dict[str, int]:
    """Logical bytes by collective kind of one micro-batch's forward and backward."""
    tokens = micro_batch * seq_length
    activation = tokens * hidden_size * activation_bytes
    loss = 3 * tokens * LOSS_BYTES
    if not sequence_parallel:
        return {
            "all_reduce": activation * (2 + 4 * num_layers) + loss,
            "all_gather": 0,
            "reduce_scatter": 0,
        }
    return {
        "all_reduce": activation + loss,
        "all_gather": activation * (6 * num_layers + 3),
        "reduce_scatter": activation * (4 * num_layers + 1),
    }


def step_bytes(
    *,
    micro_batches: int,
    sequence_parallel_grad_bytes: int,
    sequence_parallel: bool,
    **micro_batch_args,
) -> dict[str, int]:
    """Logical bytes by kind of one step: micro_batches micro-batches, then (sequence
    parallelism) one all-reduce of the sequence-parallel parameters' gradients."""
    one = micro_batch_bytes(sequence_parallel=sequence_parallel, **micro_batch_args)
    total = {kind: micro_batches * size for kind, size in one.items()}
    if sequence_parallel:
        total["all_reduce"] += sequence_parallel_grad_bytes
    return total


def wire_bytes(logical: dict[str, int], tp: int) -> float:
    """Bytes each rank sends over a ring: 2 (tp-1)/tp of an all-reduce, (tp-1)/tp of an
    all-gather's output or a reduce-scatter's input."""
    if tp == 1:
        return 0.0
    share = (tp - 1) / tp
    return share * (2 * logical["all_reduce"] + logical["all_gather"] + logical["reduce_scatter"])
