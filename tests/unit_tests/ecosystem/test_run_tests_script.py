"""scripts/run_tests.sh, the README's test command: a run that collects nothing fails with one
line saying so (pytest's exit 5 is not a pass), with and without pytest-xdist; TEST_WORKERS=2
runs the tests in xdist workers, but not with -s; a TEST_WORKERS that is not a number exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.ecosystem.test_readme_blocks import QUICK_TEST, REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _installed_here() -> None:
    """Skip unless this interpreter's installed megatron is this checkout (as setup_env.sh
    checks from /): otherwise run_tests.sh would reinstall it, pointing the venv here."""
    code = "import megatron, os; print(os.path.dirname(os.path.dirname(megatron.__file__)))"
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    if done.returncode != 0 or Path(done.stdout.strip()) != REPO_ROOT:
        pytest.skip("megatron is installed from another tree")


def _run_tests(*args: str, workers: int | str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.update(PYTHON=sys.executable, MCORE_VENV="off", TEST_WORKERS=str(workers))
    return subprocess.run(
        ["bash", "scripts/run_tests.sh", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_that_collects_nothing_fails_loudly(workers: int) -> None:
    done = _run_tests(QUICK_TEST, "-k", "no_test_is_named_this", workers=workers)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "ERROR: pytest collected no tests"


def test_two_workers_run_the_tests_in_xdist_processes(tmp_path: Path) -> None:
    probe = tmp_path / "test_worker_probe.py"
    probe.write_text(
        "import os\n\n\n"
        "def test_runs_in_a_worker():\n"
        "    assert os.environ['PYTEST_XDIST_WORKER'] in ('gw0', 'gw1')\n"
    )
    done = _run_tests(str(probe), workers=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
    for workers, args in ((1, ()), (2, ("-s",))):  # one process: no worker
        done = _run_tests(str(probe), *args, workers=workers)
        assert done.returncode == 1 and "KeyError: 'PYTEST_XDIST_WORKER'" in done.stdout


def test_test_workers_not_a_number_exits_2_with_one_line() -> None:
    done = _run_tests(QUICK_TEST, workers="auto")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "run_tests.sh: TEST_WORKERS must be a whole number of processes, got 'auto' (1: no workers)"
    ]
