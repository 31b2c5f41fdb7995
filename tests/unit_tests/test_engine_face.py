"""The Megatron-FSDP engine sees FP8 through one face: every module under
megatron/core/distributed/ imports from megatron.core.fp8 only as
megatron.core.fp8.engine_interface (module-level and function-level imports alike, read with
`ast`), and nothing in megatron/core/fp8/ imports megatron.core.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "megatron" / "core" / "distributed"
FP8 = REPO / "megatron" / "core" / "fp8"
FACE = "megatron.core.fp8.engine_interface"


def _imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import anywhere in `source` (a module of `package`):
    `import a.b` gives a.b, `from a import b` gives a.b (b a module or a name in a); relative
    imports are resolved from `package`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return sorted(found)


def _module_imports(path: Path) -> list[tuple[int, str]]:
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    return _imports(path.read_text(), package)


def _bypasses_face(name: str) -> bool:
    in_fp8 = name == "megatron.core.fp8" or name.startswith("megatron.core.fp8.")
    return in_fp8 and name != FACE and not name.startswith(FACE + ".")


def test_engine_imports_fp8_only_through_the_face():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) >= 20  # the walk found the engine
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in files
        for line, name in _module_imports(path)
        if _bypasses_face(name)
    ]
    assert bad == []


def test_engine_uses_the_face():
    users = {
        path.name
        for path in ENGINE.rglob("*.py")
        if any(name.startswith(FACE + ".") for _, name in _module_imports(path))
    }
    assert {"fp8_storage.py", "fp8_layout.py", "param_and_grad_buffer.py"} <= users


def test_the_check_catches_every_kind_of_bypass():
    source = (
        "import megatron.core.fp8.recipe\n"
        "from megatron.core.fp8.engine_interface import QuantizedTensor\n"
        "def f():\n"
        "    from ...fp8.linear import Fp8Linear\n"
        "    from megatron.core.fp8 import quantize\n"
        "    from megatron.core import fp8\n"
    )
    names = [name for _, name in _imports(source, "megatron.core.distributed.fsdp")]
    assert [_bypasses_face(name) for name in names] == [True, False, True, True, True]
    assert names[2] == "megatron.core.fp8.linear.Fp8Linear"


def test_fp8_never_imports_the_engine():
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted(FP8.rglob("*.py"))
        for line, name in _module_imports(path)
        if name.startswith("megatron.core.distributed")
    ]
    assert bad == []
