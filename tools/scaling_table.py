"""Print docs/SCALING.md's tables: per-step bytes per link class, ZeRO-3 vs HSDP, bf16 vs FP8.

    python tools/scaling_table.py > /tmp/tables.md

Bytes come from megatron.core.distributed.fsdp.traffic (the formulas the HSDP tests check
against gloo counters); compute time is the Model A step measured on one H200
(docs/benchmarks/model_a_dp1_compile_h200_2026-12-01.md), scaled by model FLOPs for the 70B
configuration at the same tokens per GPU. Assumptions are listed in docs/SCALING.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.distributed.fsdp.traffic import (
    Unit,
    counter_bytes,
    state_bytes_per_gpu,
    wire_bytes,
)
from megatron.core.models.gpt.flops import (
    count_parameters_from_config,
    layer_parameters,
    norm_parameters,
    num_floating_point_operations,
)
from megatron.core.tensor_parallel import traffic as tp_traffic
from megatron.core.transformer.transformer_config import TransformerConfig

GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 270e9  # H200 NVLink, per GPU, achievable bus bandwidth
NETWORK_BYTES_PER_S = 50e9  # 400 Gb/s InfiniBand, one NIC per GPU
HBM_BYTES = 141e9
TOKENS_PER_GPU = 2 * 4096  # Model A's measured step: micro-batch 2 x sequence 4096
MEASURED_MS = {"bf16": 233.8, "fp8": 186.7}  # Model A, DP=1, compiled; fp8 = tensorwise params

MODEL_A = TransformerConfig(
    num_layers=8,
    hidden_size=4096,
    num_attention_heads=32,
    ffn_hidden_size=14336,
    swiglu=True,
    vocab_size=32768,
    max_sequence_length=4096,
    normalization="RMSNorm",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
)
LLAMA_70B = TransformerConfig(
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_query_groups=8,
    ffn_hidden_size=28672,
    swiglu=True,
    vocab_size=128256,
    max_sequence_length=4096,
    normalization="RMSNorm",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
)


def sequence_parallel_parameters(config: TransformerConfig) -> int:
    """Parameters whose gradients sequence parallelism all-reduces over TP once per step: each
    layer's two norms and, with biases, its two row-parallel biases; the final norm."""
    biases = 2 * config.hidden_size if config.add_bias_linear else 0
    return config.num_layers * (2 * norm_parameters(config) + biases) + norm_parameters(config)


@dataclass(frozen=True)
class Row:
    model: str
    gpus: int
    layout: str
    precision: str
    nvlink_gb: float
    network_gb: float
    comm_ms: float
    compute_ms: float
    state_gb: float

    @property
    def exposed_ms(self) -> float:
        return max(0.0, self.comm_ms - self.compute_ms)


def _units(config: TransformerConfig, precision: str) -> tuple[Unit, list[Unit], int]:
    """(root, layers, FP8 elements): norms, embedding and head stay bf16 under FP8."""
    layer = layer_parameters(config)
    norms = 2 * config.hidden_size
    total = count_parameters_from_config(config)
    root = Unit(total - config.num_layers * layer, 2)
    if precision == "bf16":
        return root, [Unit(layer, 2)] * config.num_layers, 0
    weights = layer - norms
    per_element = (weights * 1 + norms * 2) / layer
    return root, [Unit(layer, per_element)] * config.num_layers, weights * config.num_layers


def _compute_ms(config: TransformerConfig, precision: str) -> float:
    flops = num_floating_point_operations(config, batch_size=1, seq_length=TOKENS_PER_GPU)
    reference = num_floating_point_operations(MODEL_A, batch_size=1, seq_length=TOKENS_PER_GPU)
    return MEASURED_MS[precision] * flops / reference


def row(name: str, config: TransformerConfig, gpus: int, layout: str, precision: str) -> Row:
    shard, outer = (gpus, 1) if layout == "ZeRO-3" else (GPUS_PER_NODE, gpus // GPUS_PER_NODE)
    strategy = "optim" if layout.endswith("optim") else "no_shard"
    root, layers, fp8_numel = _units(config, precision)
    stats = counter_bytes(root, layers, shard_size=shard, outer_size=outer, outer_strategy=strategy)
    links = wire_bytes(stats, shard_size=shard, outer_size=outer, gpus_per_node=GPUS_PER_NODE)
    # The two link classes carry different collectives and run concurrently.
    comm_s = max(links["nvlink"] / NVLINK_BYTES_PER_S, links["network"] / NETWORK_BYTES_PER_S)
    state = state_bytes_per_gpu(
        count_parameters_from_config(config),
        shard_size=shard,
        outer_size=outer,
        outer_strategy=strategy,
        fp8_numel=fp8_numel,
    )
    return Row(
        name,
        gpus,
        layout,
        precision,
        links["nvlink"] / 1e9,
        links["network"] / 1e9,
        comm_s * 1e3,
        _compute_ms(config, precision),
        state / 1e9,
    )


def table(name: str, config: TransformerConfig) -> str:
    lines = [
        "| GPUs | layout | params | NVLink GB/GPU | network GB/GPU | comm ms | compute ms "
        "| exposed ms | state GB/GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gpus in (8, 64, 256, 1024):
        layouts = ["ZeRO-3"] if gpus == GPUS_PER_NODE else ["ZeRO-3", "HSDP", "HSDP optim"]
        for layout in layouts:
            for precision in ("bf16", "fp8"):
                r = row(name, config, gpus, layout, precision)
                fits = "" if r.state_gb < HBM_BYTES / 1e9 else " (does not fit)"
                lines.append(
                    f"| {gpus} | {layout} | {precision} | {r.nvlink_gb:.2f} | "
                    f"{r.network_gb:.2f} | {r.comm_ms:.1f} | {r.compute_ms:.0f} | "
                    f"{r.exposed_ms:.1f} | {r.state_gb:.1f}{fits} |"
                )
    return "\n".join(lines)


def tensor_parallel_gb(config: TransformerConfig, tp: int, *, sequence_parallel: bool) -> float:
    """GB one GPU sends per step over its TP group (a ring): one micro-batch of
    TOKENS_PER_GPU tokens per TP group, bf16 activations, bf16 grads of the
    sequence-parallel parameters."""
    logical = tp_traffic.step_bytes(
        micro_batches=1,
        sequence_parallel_grad_bytes=2 * sequence_parallel_parameters(config),
        sequence_parallel=sequence_parallel,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        micro_batch=TOKENS_PER_GPU // config.max_sequence_length,
        seq_length=config.max_sequence_length,
        activation_bytes=2,
    )
    return tp_traffic.wire_bytes(logical, tp) / 1e9


def tp_row(config: TransformerConfig, gpus: int, tp: int) -> str:
    """TP x ZeRO-3 over the rest (bf16): the TP bytes (exposed: Megatron-LM's TP collectives
    wait for the GEMMs around them) and the data-parallel bytes of the TP shards."""
    dp = gpus // tp
    tp_gb = {sp: tensor_parallel_gb(config, tp, sequence_parallel=sp) for sp in (False, True)}
    tp_ms = tp_gb[True] * 1e9 / NVLINK_BYTES_PER_S * 1e3
    compute_ms = _compute_ms(config, "bf16") / tp
    root, layers, _ = _units(config, "bf16")
    root, layers = Unit(root.numel // tp, 2), [Unit(u.numel // tp, 2) for u in layers]
    stats = counter_bytes(root, layers, shard_size=dp)
    links = wire_bytes(stats, shard_size=dp, outer_size=1, gpus_per_node=GPUS_PER_NODE // tp)
    dp_ms = max(links["nvlink"] / NVLINK_BYTES_PER_S, links["network"] / NETWORK_BYTES_PER_S) * 1e3
    params = count_parameters_from_config(config) // tp
    state = state_bytes_per_gpu(params, shard_size=dp, outer_size=1, outer_strategy="no_shard")
    return (
        f"| {gpus} | {tp} x {dp} | {tp_gb[False]:.2f} | {tp_gb[True]:.2f} | {tp_ms:.1f} "
        f"| {dp_ms:.1f} | {compute_ms:.0f} | {tp_ms + max(0.0, dp_ms - compute_ms):.1f} "
        f"| {state / 1e9:.1f} |"
    )


def tp_table(config: TransformerConfig) -> str:
    lines = [
        "| GPUs | TP x DP | TP GB/GPU | TP GB/GPU (SP) | TP ms (SP, exposed) | DP comm ms "
        "| compute ms | exposed ms | state GB/GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gpus in (8, 64):
        lines += [tp_row(config, gpus, tp) for tp in (1, 2, 4, 8)]
    return "\n".join(lines)


def main() -> None:
    for name, config in (("Model A", MODEL_A), ("Llama-style 70B", LLAMA_70B)):
        params = count_parameters_from_config(config) / 1e9
        print(f"### {name} ({params:.2f} B parameters)\n")
        print(table(name, config))
        print()
    for name, config in (("Model A", MODEL_A), ("Llama-style 70B", LLAMA_70B)):
        print(f"### {name}: tensor parallelism x ZeRO-3, bf16\n")
        print(tp_table(config))
        print()


if __name__ == "__main__":
    main()
