"""megatron/ reads environment variables only in megatron/core/environment.py, and only those
its table names with a reason (issue 35)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from megatron.core.environment import VARIABLES, adopt_slurm_launch, env_int, get_env

REPO = Path(__file__).resolve().parents[3]
READERS = {"environ", "getenv", "environb", "getenvb"}


def _environment_reads(path: Path) -> list[int]:
    """The line of each `os.environ` / `os.getenv` (or the bare names) in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in READERS:
            found.append(node.lineno)
        if isinstance(node, ast.Name) and node.id in READERS:
            found.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [node.lineno for alias in node.names if alias.name in READERS]
    return found


def test_environment_is_read_only_in_environment_py():
    files = sorted((REPO / "megatron").rglob("*.py")) + [REPO / "pretrain_gpt.py"]
    reads = {path.relative_to(REPO).as_posix(): _environment_reads(path) for path in files}
    assert len(reads["megatron/core/environment.py"]) == 4  # get_env, three Slurm mappings
    outside = [
        f"{path}:{line}"
        for path, lines in reads.items()
        if path != "megatron/core/environment.py"
        for line in lines
    ]
    assert outside == []


def test_the_scan_finds_each_kind_of_read(tmp_path):
    module = tmp_path / "leaky.py"
    module.write_text(
        "import os\nfrom os import getenv\nA = os.environ.get('X')\nB = getenv('Y')\n"
        "C = os.getenv('Z')\n"
    )
    assert sorted(_environment_reads(module)) == [2, 3, 4, 5]


def test_unlisted_name_is_refused_and_listed_names_read(monkeypatch):
    with pytest.raises(KeyError, match="not in megatron.core.environment.VARIABLES"):
        get_env("MEGATRON_SOMETHING_NEW")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert env_int("WORLD_SIZE", 1) == 8
    monkeypatch.delenv("WORLD_SIZE")
    assert env_int("WORLD_SIZE", 1) == 1
    assert all(reason for reason in VARIABLES.values())


def test_slurm_launch_is_mapped_onto_torchrun_names(monkeypatch):
    # A private copy of the environment: adopt_slurm_launch writes RANK, WORLD_SIZE and
    # LOCAL_RANK, which must not reach the tests that run after this one.
    monkeypatch.setattr(
        os, "environ", {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    )
    adopt_slurm_launch()
    assert (env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0)) == (3, 4, 1)
