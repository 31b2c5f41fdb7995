"""docs/SCALING.md holds the current output of tools/scaling_table.py, whose cells follow the
traffic formulas (the ones test_hsdp.py checks against measured counters)."""

from __future__ import annotations

import os

import pytest

from megatron.core.models.gpt.flops import count_parameters_from_config
from tools.scaling_table import LLAMA_70B, MODEL_A, main, row, tensor_parallel_gb

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "SCALING.md")


def test_doc_tables_are_the_tool_output(capsys) -> None:
    main()
    printed = capsys.readouterr().out
    with open(DOC) as handle:
        doc = handle.read()
    table_lines = [line for line in printed.splitlines() if line.startswith("|")]
    # Per model: header + rule + 20 layout rows; then header + rule + 8 TP x DP rows.
    assert len(table_lines) == 2 * (2 + 2 + 3 * 3 * 2) + 2 * (2 + 8)
    for line in table_lines:
        assert line in doc, line


def test_hsdp_network_bytes_are_one_grad_shard_all_reduced() -> None:
    params = count_parameters_from_config(MODEL_A)
    assert params == pytest.approx(2.21e9, rel=0.01)
    for gpus in (64, 256, 1024):
        replicas = gpus // 8
        got = row("A", MODEL_A, gpus, "HSDP", "bf16")
        # fp32 grads of a 1/8 shard (root and layers padded to 8: exact here), ring all-reduce.
        assert got.network_gb * 1e9 == pytest.approx(
            params / 8 * 4 * 2 * (replicas - 1) / replicas, rel=1e-9
        )
        # Inner traffic is the one-node ZeRO-3's, on NVLink.
        assert got.nvlink_gb == row("A", MODEL_A, 8, "ZeRO-3", "bf16").nvlink_gb
    # 70B: the node-sharded state does not fit an H200 unless the moments split across nodes.
    assert row("70B", LLAMA_70B, 64, "HSDP", "bf16").state_gb > 141
    assert row("70B", LLAMA_70B, 64, "HSDP optim", "bf16").state_gb < 80


def test_tensor_parallel_bytes_by_hand() -> None:
    """Model A at TP 2, no sequence parallelism: 4 all-reduces of one bf16 activation per
    layer plus two (embedding, output-layer input gradient) and three fp32 [B, S] loss
    all-reduces; a ring sends 2 (t-1)/t of each."""
    activation = 2 * 4096 * 4096 * 2
    logical = activation * (2 + 4 * 8) + 3 * 2 * 4096 * 4
    assert tensor_parallel_gb(MODEL_A, 2, sequence_parallel=False) * 1e9 == pytest.approx(
        logical, rel=1e-12
    )
    assert tensor_parallel_gb(MODEL_A, 1, sequence_parallel=True) == 0.0
