"""The README's "Set up and run" commands, top to bottom, as written, on a fresh clone (CPU):
each block exits 0. The quickstart runs are shortened with QUICKSTART_ITERS (same run
directories) and the test command is narrowed to one small test file; everything else is the
README's text. The clone is of the committed HEAD. Also: every tool given a missing file exits 2
with one `error:` line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SECTION = "## Set up and run"
QUICK_TEST = "tests/unit_tests/test_import_graph.py"


def _setup_blocks() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def test_the_setup_section_has_its_blocks() -> None:
    blocks = _setup_blocks()
    assert [block.splitlines()[0] for block in blocks] == [
        "bash scripts/quickstart.sh",
        "bash scripts/quickstart.sh --fp8-recipe tensorwise",
        "bash scripts/run_tests.sh",
    ]


@pytest.mark.slow
def test_readme_blocks_run_in_order_on_a_fresh_clone(tmp_path: Path) -> None:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    unset = ("PYTHONPATH", "PYTHON", "VIRTUAL_ENV", "MEGATRON_NO_VENV", "RUN_NAME", "OUTPUT_DIR")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    # The one test file run needs no megatron-core venv: run_tests.sh does not make one.
    env.update(QUICKSTART_ITERS="4", MCORE_VENV="off")
    for block in _setup_blocks():
        command = block.replace(
            "bash scripts/run_tests.sh", f"bash scripts/run_tests.sh {QUICK_TEST}"
        )
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert (clone / ".venv" / "bin" / "python").is_file()
    assert (clone / "losses.png").stat().st_size > 0
    assert (clone / "hf_model" / "config.json").is_file()


# Every tool that reads a file, pointed at one that does not exist (scaling_table.py reads none).
MISSING = "/nonexistent/megatron-fp8-test"
TOOL_CALLS = {
    "plot_losses": ["tools/plot_losses.py", f"{MISSING}.log", "--output", f"{MISSING}.png"],
    "preprocess_data": [
        *("tools/preprocess_data.py", "--input", f"{MISSING}.jsonl"),
        *("--output-prefix", MISSING, "--tokenizer-type", "ByteTokenizer"),
    ],
    "convert": [
        *("tools/checkpoint/convert.py", "--loader", "megatron_fp8", "--saver", "hf"),
        *("--load-dir", MISSING, "--save-dir", f"{MISSING}-out"),
    ],
    "convert_to_hf": ["tools/checkpoint/convert_to_hf.py", "--load", MISSING, "--output", MISSING],
}


@pytest.mark.parametrize("argv", TOOL_CALLS.values(), ids=TOOL_CALLS.keys())
def test_a_tool_given_a_missing_file_exits_2_with_one_error_line(argv) -> None:
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "error: " in lines[0] and MISSING in lines[0], done.stderr
