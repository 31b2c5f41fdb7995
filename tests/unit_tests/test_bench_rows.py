"""benchmarks/rows.sh, the helpers every row script sources: `row` keeps the command's exit
status and log, `summarize` takes the median and mean of the iterations after WARMUP and the
largest "max allocated", and CLOCKS=1 samples `nvidia-smi dmon` beside the row (a stand-in
nvidia-smi here) and stops the sampler when the row ends."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_SMI = """#!/usr/bin/env bash
echo "args $*"
while true; do echo "sample 1980 MHz"; sleep 0.1; done
"""

ROW_CMD = """
sleep 0.5  # the sampler starts and writes while the row runs
for t in 900.0 150.0 160.0 140.0 170.0; do
  echo "elapsed time per iteration (ms): $t | max allocated: ${t%.*}.5"
done
exit 3
"""


def _run_rows(tmp_path: Path, clocks: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    script = (
        f"source {ROOT}/benchmarks/rows.sh\n"
        f"row demo bash -c '{ROW_CMD}'\n"
        "summarize demo\n"
        "sleep 0.3\n"  # a sampler left running would keep writing after this
        'wc -l < "$OUT/demo.dmon" > "$OUT/lines_then" 2>/dev/null || true\n'
    )
    env = dict(os.environ, OUT=str(tmp_path), WARMUP="1", ROWS_NAME="job", CLOCKS=clocks)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def test_row_status_and_summary(tmp_path):
    result = _run_rows(tmp_path, clocks="0")
    assert result.returncode == 0, result.stderr
    assert "exit 3 (demo)" in (tmp_path / "job.log").read_text()
    summary = json.loads((tmp_path / "job.jsonl").read_text().splitlines()[-1])
    # After 1 warm-up iteration: 150, 160, 140, 170 -> median 155, mean 155; peak 900.5.
    assert summary == {
        "row": "demo",
        "step_ms": 155.0,
        "mean_ms": 155.0,
        "steps": 4,
        "peak_mem_gib": 900.5,
    }
    assert not (tmp_path / "demo.dmon").exists()


def test_clocks_are_sampled_while_the_row_runs_and_stop_with_it(tmp_path):
    result = _run_rows(tmp_path, clocks="1")
    assert result.returncode == 0, result.stderr
    dmon = (tmp_path / "demo.dmon").read_text().splitlines()
    assert dmon[0] == "args dmon -s pc -d 1 -o T" and len(dmon) >= 2
    assert "exit 3 (demo)" in (tmp_path / "job.log").read_text()
    lines_then = int((tmp_path / "lines_then").read_text())
    # The sampler was stopped: nothing more is written after the row ended.
    subprocess.run(["sleep", "0.3"], check=True)
    assert len((tmp_path / "demo.dmon").read_text().splitlines()) == lines_then
