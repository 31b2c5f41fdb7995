"""The project's import graph, read from the source with `ast`: no cycle among the modules of
megatron/, tools/ and pretrain_gpt.py, and no project import inside a function body (an import
statement or `importlib.import_module`) except the modules of ALLOWED_IN_FUNCTION.

Edges are module-level imports (an `if TYPE_CHECKING:` block is left out: it never runs). An
import `from package import name` is an edge to `package.name` when that is a module of the
project, else to `package`. A function body is any def or lambda, at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT_ROOTS = ("megatron", "tools")

# Project modules that may be imported inside a function, by (importing file, imported module),
# each because it needs an optional dependency and its caller falls back without it.
ALLOWED_IN_FUNCTION = {
    # Triton kernels (`import triton` at module level); without Triton the engine copies grads
    # with torch ops.
    (
        "megatron/core/distributed/fsdp/grad_copy.py",
        "megatron.core.distributed.fsdp.triton_grad_copy",
    ),
    ("megatron/core/fp8/cuda/quantize_common.py", "megatron.core.fp8.cuda.triton_quantize"),
    # The experts' FP8 grouped GEMM kernels; without Triton one emulated GEMM per expert.
    ("megatron/core/fp8/cuda/grouped_gemm.py", "megatron.core.fp8.cuda.triton_grouped_gemm"),
    # FusedAdamW's CUDA step; without Triton it runs torch's AdamW step.
    ("megatron/core/optimizer/fused_adamw.py", "megatron.core.optimizer.triton_adamw"),
    # megatron.core.fp8.cuda, the CUDA-only FP8 kernel paths: loaded on the first CUDA tensor,
    # and where it does not import the reference (pure torch) path runs instead.
    ("megatron/core/fp8/autocast.py", "megatron.core.fp8.cuda.quantize_per_tensor"),
    ("megatron/core/fp8/quantized_tensor.py", "megatron.core.fp8.cuda"),
    # Not an optional dependency: the package resolves its names on first use
    # (importlib.import_module in __getattr__) so that preprocessing workers, which import
    # only indexed_dataset, never import torch.
    ("megatron/core/datasets/__init__.py", "megatron.core.datasets.*"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = REPO) -> dict[str, Path]:
    files = [path for top in PROJECT_ROOTS for path in sorted((root / top).rglob("*.py"))]
    if (root / "pretrain_gpt.py").is_file():
        files.append(root / "pretrain_gpt.py")
    return {_module_name(path, root): path for path in files}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, *, module: str, modules: dict) -> list[str]:
    """The project modules an import statement loads (none for a third-party import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.append(f"{base}.{alias.name}")
        elif base in modules:
            found.append(base)
    return found


def _dynamic_target(node: ast.Call, *, module: str, modules: dict) -> str | None:
    """The project module an `importlib.import_module(...)` call loads: a literal name, or
    "<this package>.*" for a name built from `__name__` (a submodule chosen at run time)."""
    function = node.func
    is_import_module = (
        isinstance(function, ast.Attribute) and function.attr == "import_module"
    ) or (isinstance(function, ast.Name) and function.id == "import_module")
    if not is_import_module or not node.args:
        return None
    name = node.args[0]
    if isinstance(name, ast.Constant) and name.value in modules:
        return name.value
    if isinstance(name, ast.JoinedStr) and name.values:
        first = name.values[0]
        if isinstance(first, ast.FormattedValue) and getattr(first.value, "id", "") == "__name__":
            return f"{module}.*"
    return None


def import_graph(
    modules: dict[str, Path], *, root: Path = REPO
) -> tuple[dict[str, set], list[tuple]]:
    """({module: modules it imports at module level}, [(file, line, imported module) of every
    project import inside a function body])."""
    graph: dict[str, set] = {}
    in_function: list[tuple] = []
    for module, path in modules.items():
        edges: set[str] = set()

        def visit(node: ast.AST, *, inside: bool, module=module, path=path, edges=edges) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for statement in child.orelse:
                        visit(ast.Module(body=[statement], type_ignores=[]), inside=inside)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, module=module, modules=modules):
                        if inside:
                            relative = path.relative_to(root).as_posix()
                            in_function.append((relative, child.lineno, target))
                        elif target != module:
                            edges.add(target)
                    continue
                if isinstance(child, ast.Call):
                    target = _dynamic_target(child, module=module, modules=modules)
                    if target is not None and inside:
                        relative = path.relative_to(root).as_posix()
                        in_function.append((relative, child.lineno, target))
                    elif target is not None and target in modules and target != module:
                        edges.add(target)
                function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inside=inside or function)

        visit(ast.parse(path.read_text(), filename=str(path)), inside=False)
        graph[module] = edges
    return graph, in_function


def find_cycle(graph: dict[str, set]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            target = next(stack[-1], None)
            if target is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(target) == 1:
                return path[path.index(target) :] + [target]
            elif target not in state:
                state[target] = 1
                path.append(target)
                stack.append(iter(sorted(graph.get(target, ()))))
    return None


def test_no_import_cycle():
    modules = project_modules()
    assert {"megatron.training.training", "tools.checkpoint.convert", "pretrain_gpt"} <= set(
        modules
    )
    graph, _ = import_graph(modules)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_project_import_inside_a_function():
    _, in_function = import_graph(project_modules())
    unexpected = [
        f"{file}:{line}: {target}"
        for file, line, target in in_function
        if (file, target) not in ALLOWED_IN_FUNCTION
    ]
    assert unexpected == [], "project imports inside functions:\n" + "\n".join(unexpected)
    # Every allowed entry still exists (a stale one would allow a future import silently).
    assert {(file, target) for file, _, target in in_function} == ALLOWED_IN_FUNCTION


def test_the_checks_find_a_cycle_and_an_import_in_a_function(tmp_path):
    """The same functions on a made-up project: a -> b -> a is found (the TYPE_CHECKING edge
    c -> a is not an edge), and b's import inside a function is reported with its line."""
    package = tmp_path / "megatron"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from megatron import b\n")
    (package / "b.py").write_text(
        "import importlib\nimport megatron.a\n\ndef late():\n    from megatron.c import thing\n"
        "    return importlib.import_module('megatron.a')\n"
    )
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron import a\n"
    )
    graph, in_function = import_graph(project_modules(tmp_path), root=tmp_path)
    assert graph["megatron.c"] == set()
    assert find_cycle(graph) == ["megatron.a", "megatron.b", "megatron.a"]
    assert in_function == [("megatron/b.py", 5, "megatron.c"), ("megatron/b.py", 6, "megatron.a")]
    (package / "b.py").write_text("def late():\n    import megatron.a\n")
    graph, _ = import_graph(project_modules(tmp_path), root=tmp_path)
    assert find_cycle(graph) is None
