"""Below `pretrain()` nothing takes the argparse Namespace: the flags become typed configs once
(megatron/training/flags/configs.py) and every function the run calls takes those.

The check is the issue's grep, `args.` anywhere in the text of megatron/core and of the training
modules below `pretrain()` (so `kwargs.` or `saved_args.` count too: name such things otherwise),
and with `ast`: no `argparse` import and no `Namespace` in those modules. Parse-time modules
keep the Namespace: flags/arguments.py, checkpoint_args.py and checks.py (parsing and validation),
flags/configs.py (builds the configs from it), flags/megatron_lm.py, megatron_lm_checks.py,
megatron_lm_table.py, mup.py, mla.py and moe.py (add, map and check Megatron-LM's flags at parse
time), flags/optimizer.py (the optimizer-state flags and their checks), flags/compile.py
(--torch-compile and its default), flags/readings.py (half-given flags read as Megatron-LM
reads them), flags/tensor_parallel.py and flags/fp8_stats.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PARSE_TIME = {
    f"flags/{name}.py"
    for name in (
        "arguments",
        "checkpoint_args",
        "checks",
        "compile",
        "configs",
        "fp8_stats",
        "megatron_lm",
        "megatron_lm_checks",
        "megatron_lm_table",
        "moe",
        "mup",
        "mla",
        "optimizer",
        "readings",
        "recompute",
        "tensor_parallel",
    )
}
ARGS_ATTRIBUTE = re.compile(r"args\.")  # as `grep -rn "args\."`


def _run_time_modules() -> list[Path]:
    core = sorted((REPO / "megatron" / "core").rglob("*.py"))
    training = sorted(
        path
        for path in (REPO / "megatron" / "training").rglob("*.py")
        if path.relative_to(REPO / "megatron" / "training").as_posix() not in PARSE_TIME
    )
    return core + training


def _namespace_uses(path: Path, *, root: Path = REPO) -> list[str]:
    """Each use, as 'file:line: what', found in the source text and in its syntax tree."""
    source = path.read_text()
    relative = path.relative_to(root)
    found = [
        f"{relative}:{number}: {line.strip()}"
        for number, line in enumerate(source.splitlines(), start=1)
        if ARGS_ATTRIBUTE.search(line)
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"{relative}:{node.lineno}: import argparse")
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"{relative}:{node.lineno}: from argparse import ...")
        if isinstance(node, ast.Attribute) and node.attr == "Namespace":
            found.append(f"{relative}:{node.lineno}: Namespace")
        if isinstance(node, ast.Name) and node.id == "Namespace":
            found.append(f"{relative}:{node.lineno}: Namespace")
    return found


def test_no_namespace_below_pretrain():
    modules = _run_time_modules()
    # The scan covers what it says: the run's modules and the core library.
    names = {path.name for path in modules}
    assert {"training.py", "save.py", "load.py", "data.py"} <= names
    assert {"model_setup.py", "run_hooks.py", "initialize.py", "async_save.py"} <= names
    assert len(modules) > 100  # megatron/core is scanned too
    uses = [use for path in modules for use in _namespace_uses(path)]
    assert uses == [], "Namespace used below pretrain():\n" + "\n".join(uses)


def test_the_scan_finds_a_namespace_use(tmp_path):
    """The check itself: each kind of use in a module is reported with its line."""
    module = tmp_path / "megatron" / "training" / "leaky.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import argparse\n"
        "def step(args: argparse.Namespace, **kwargs):\n"
        "    kwargs.get('x')\n"
        "    return args.seed\n"
    )
    uses = _namespace_uses(module, root=tmp_path)
    assert [use.split(": ", 1)[0] for use in uses] == [
        "megatron/training/leaky.py:3",
        "megatron/training/leaky.py:4",
        "megatron/training/leaky.py:1",
        "megatron/training/leaky.py:2",
    ]
