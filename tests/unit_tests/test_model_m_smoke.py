"""benchmarks/moe_model_m.sh at CPU sizes (TINY=1, gloo): the command lines of the FSDP2 MoE
peer and of our tensorwise row parse and run 2 iterations each (bf16 and blockwise differ from
tensorwise only in --fp8-recipe; tensorwise_nofusion adds --no-gradient-accumulation-fusion);
each row reports 2 timed steps (ours) or a step time (the
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
    env.update(WARMUP="0", ROWS="fsdp2 tensorwise tensorwise_nofusion", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        ["bash", "benchmarks/moe_model_m.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "model_m.jsonl").read_text().splitlines()
    rows = {r.get("row", r.get("model")): r for r in map(json.loads, lines)}
    assert sorted(rows) == ["moe_peer", "tensorwise", "tensorwise_nofusion"]
    for name in ("tensorwise", "tensorwise_nofusion"):
        assert rows[name]["steps"] == 2 and rows[name]["step_ms"] > 0, rows
    assert rows["moe_peer"]["step_ms"] > 0 and rows["moe_peer"]["world_size"] == 1
    log = (tmp_path / "model_m.log").read_text()
    assert "exit 0 (fsdp2)" in log
    # <recipe>_nofusion: the recipe's command line with --no-gradient-accumulation-fusion.
    commands = {line.split(":")[0]: line for line in log.splitlines() if line.startswith("== ")}
    fused, unfused = commands["== tensorwise"], commands["== tensorwise_nofusion"]
    assert "--fp8-recipe tensorwise " in unfused and "gradient-accumulation-fusion" not in fused
    assert unfused.endswith("--fp8-param-gather --no-gradient-accumulation-fusion")


@pytest.mark.timeout(900)
def test_deepseek_model_m_rows_run_two_steps_on_cpu(tmp_path):
    """DEEPSEEK=1 (issue 39, acceptance 4): the DeepSeek-V3-style model M's command line (MLA,
    dense first layer, shared expert, sigmoid group-limited routing with the expert bias,
    sequence aux loss, MTP 1) parses and runs 2 iterations at CPU sizes under FP8 tensorwise
    parameters; the peer row is skipped with its reason (it builds none of these blocks)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), TINY="1", ITERS="2")
    env.update(WARMUP="0", ROWS="fsdp2 tensorwise", DEEPSEEK="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        ["bash", "benchmarks/moe_model_m.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "model_m_deepseek.jsonl").read_text().splitlines()
    rows = {r["row"]: r for r in map(json.loads, lines)}
    assert sorted(rows) == ["tensorwise"]
    assert rows["tensorwise"]["steps"] == 2 and rows["tensorwise"]["step_ms"] > 0, rows
    log = (tmp_path / "tensorwise.log").read_text()
    assert "--multi-latent-attention" in (tmp_path / "model_m_deepseek.log").read_text()
    assert log.count("mtp_1 loss: ") == 2 and log.count("seq_load_balancing_loss: ") == 2, log
    assert "skip fsdp2: the peer has no multi-latent attention" in result.stdout


@pytest.mark.timeout(900)
def test_old_vs_new_takes_the_model_m_script(tmp_path):
    """benchmarks/model_a_old_vs_new.sh with BENCH=benchmarks/moe_model_m.sh (this checkout as
    both trees, TINY=1): PRE_ROWS once on the new tree, then each row on both; the table's
    new/old and the ratio to our bf16 row come from the two trees' JSON lines."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), TINY="1", ITERS="2")
    env.update(WARMUP="0", OLD=str(ROOT), BENCH="benchmarks/moe_model_m.sh")
    env.update(PRE_ROWS="bf16", ROWS="tensorwise", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        ["bash", "benchmarks/model_a_old_vs_new.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def rows(tree):
        lines = (tmp_path / tree / "model_m.jsonl").read_text().splitlines()
        return {r["row"]: r for r in map(json.loads, lines)}

    old, new = rows("old"), rows("new")
    assert sorted(old) == ["tensorwise"] and sorted(new) == ["bf16", "tensorwise"]
    o, n, b = old["tensorwise"]["step_ms"], new["tensorwise"]["step_ms"], new["bf16"]["step_ms"]
    table = (tmp_path / "old_vs_new.txt").read_text()
    assert f"| tensorwise | {o} | {n} | {n / o:.4f} |" in table
    assert f"new rows vs bf16 ({b} ms" in table
    assert f"tensorwise: {b / n:.3f}x speed" in table
