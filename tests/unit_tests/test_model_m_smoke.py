"""benchmarks/moe_model_m.sh at CPU sizes (TINY=1, gloo): the command lines of the FSDP2 MoE
peer and of our tensorwise row parse and run 2 iterations each (bf16 and blockwise differ from
tensorwise only in --fp8-recipe); each row reports 2 timed steps (ours) or a step time (the
peer)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_model_m_script_rows_run_two_steps_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), TINY="1", ITERS="2")
    env.update(WARMUP="0", ROWS="fsdp2 tensorwise", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        ["bash", "benchmarks/moe_model_m.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "model_m.jsonl").read_text().splitlines()
    rows = {r.get("row", r.get("model")): r for r in map(json.loads, lines)}
    assert sorted(rows) == ["moe_peer", "tensorwise"]
    assert rows["tensorwise"]["steps"] == 2 and rows["tensorwise"]["step_ms"] > 0, rows
    assert rows["moe_peer"]["step_ms"] > 0 and rows["moe_peer"]["world_size"] == 1
    assert "exit 0 (fsdp2)" in (tmp_path / "model_m.log").read_text()
