"""The house rules that a reader of the source can check (docs/STYLE.md, docs/ARCHITECTURE.md),
read from the source with `ast`:

- no file in megatron/ over 600 lines (a file of Triton kernels: 800);
- no function over 80 lines, except `@triton.jit` kernels;
- line budgets: megatron/core/fp8/ and the flag-to-config layer (issue 35) do not grow back;
- each FP8 constant and quantization rule is defined in exactly one module;
- no test, benchmark or dev script assigns a module-level data attribute of a megatron module
  (a lab switch): spying on a function with monkeypatch is allowed, flipping a value is not;
- (environment variables: tests/unit_tests/training/test_environment.py);
- the packages import one another only as docs/ARCHITECTURE.md's "may import" table says.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

from tests.unit_tests.test_import_graph import REPO, import_graph, project_modules

MAX_FILE_LINES = 600
MAX_TRITON_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _product_files() -> list[Path]:
    return sorted((REPO / "megatron").rglob("*.py"))


def _is_triton_jit(node: ast.AST) -> bool:
    for decorator in getattr(node, "decorator_list", []):
        text = ast.unparse(decorator)
        if text.startswith(("triton.jit", "tl.jit", "jit")):
            return True
    return False


def test_no_file_over_the_house_limit():
    long = []
    for path in _product_files():
        text = path.read_text()
        limit = MAX_TRITON_FILE_LINES if "@triton.jit" in text else MAX_FILE_LINES
        lines = text.count("\n")
        if lines > limit:
            long.append(f"{path.relative_to(REPO)}: {lines} lines (limit {limit})")
    assert long == [], "split these by responsibility:\n" + "\n".join(long)


# Line budgets (issue 35, acceptance 4), counted as `wc -l` counts: every .py file under
# megatron/core/fp8/, and the flag-to-config layer's files (megatron/training/flags/). The budget
# holds the features fp8/ had at issue 35; a file added for a later feature is named here with
# its feature and counted apart (it still obeys the per-file limits above).
FP8_LINE_BUDGET = 6485
FP8_LATER_FEATURE_FILES = {
    "cuda/grouped_gemm.py": "MoE experts' FP8 grouped GEMMs (issue 38)",
    "cuda/triton_grouped_gemm.py": "MoE experts' FP8 grouped GEMMs (issue 38)",
    "main_grad.py": "gradient accumulation fusion: wgrad into the engine's buffer (issue 37)",
}
FLAG_LAYER_FILES = (
    "arguments",
    "checks",
    "megatron_lm",
    "megatron_lm_checks",
    "configs",
    "run_config",
    "checkpoint_args",
)
FLAG_LAYER_LINE_BUDGET = 2606


def _line_count(paths) -> int:
    return sum(path.read_text().count("\n") for path in paths)


def test_fp8_package_and_flag_layer_stay_within_their_line_budgets():
    fp8_root = REPO / "megatron/core/fp8"
    later = [fp8_root / name for name in FP8_LATER_FEATURE_FILES]
    assert all(path.is_file() for path in later), "a named later-feature file is gone"
    fp8_files = sorted(set(fp8_root.rglob("*.py")) - set(later))
    flags = REPO / "megatron/training/flags"
    flag_files = [flags / f"{name}.py" for name in FLAG_LAYER_FILES]
    assert len(fp8_files) >= 25 and all(path.is_file() for path in flag_files)
    fp8_lines, flag_lines = _line_count(fp8_files), _line_count(flag_files)
    assert 1000 < fp8_lines < FP8_LINE_BUDGET, f"megatron/core/fp8/: {fp8_lines} lines"
    assert 500 < flag_lines < FLAG_LAYER_LINE_BUDGET, f"flag-to-config layer: {flag_lines} lines"


def long_functions(path: Path, *, root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name (N lines)' for each def longer than `limit` lines, Triton kernels aside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_triton_jit(node):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        lines = node.end_lineno - start + 1
        if lines > limit:
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_the_house_limit():
    found = [entry for path in _product_files() for entry in long_functions(path)]
    assert found == [], "functions over 80 lines:\n" + "\n".join(found)


def test_the_length_check_counts_decorators_and_skips_kernels(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    path = tmp_path / "m.py"
    path.write_text(
        f"def fits():\n{body}\n\n@staticmethod\ndef over():\n{body}\n\n"
        f"@triton.jit\ndef kernel():\n{body}\n    y = 1\n"
    )
    # fits: def line + 79 = 80 lines; over: its decorator makes 81; the kernel is exempt.
    assert long_functions(path, root=tmp_path) == ["m.py:83 over (81 lines)"]


# Each FP8 constant and rule of issue 35, defined (a module-level def or assignment) in exactly
# one module of megatron/core/fp8 (Triton device functions, another language, do not count).
ONE_DEFINITION = (
    "FP8_DTYPES",
    "ROLES",
    "FLT_MAX",
    "fp8_max",
    "check_fp8_dtype",
    "scale_from_amax",
    "reciprocal",
    "saturating_cast",
    "e8m0_from_amax",
    "block_scales",
    "quantize_blocks",
    "dequantize_cells",
    "quantized_model_init",
)
# The block shapes of the recipes (1x128, 128x128, 1x32) are fields of recipe.py's RecipeSpecs;
# no other module names a block size.
BLOCK_NAME = re.compile(r"^_?(BLOCK|MX_BLOCK|BLOCK_\d+|.*_BLOCK)$")


def module_level_definitions(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not _is_triton_jit(node):
                names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            if isinstance(node.value, (ast.Name, ast.Attribute)):
                continue  # another name for a definition made elsewhere, not a second one
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_each_fp8_rule_is_defined_once():
    definitions: dict[str, list[str]] = {}
    for path in sorted((REPO / "megatron").rglob("*.py")):
        for name in module_level_definitions(path):
            definitions.setdefault(name, []).append(str(path.relative_to(REPO)))
    twice = {name: definitions.get(name, []) for name in ONE_DEFINITION}
    assert {name: len(files) for name, files in twice.items()} == dict.fromkeys(
        ONE_DEFINITION, 1
    ), twice
    assert "TENSOR_ROLES" not in definitions
    blocks = {
        name: files
        for name, files in definitions.items()
        if BLOCK_NAME.match(name) and any("core/fp8" in f for f in files)
    }
    outside = {n: f for n, f in blocks.items() if f != ["megatron/core/fp8/recipe.py"]}
    assert outside == {}, f"block sizes named outside recipe.py: {outside}"


# ----- no lab switches flipped from outside ---------------------------------------------------


def _megatron_module_aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: megatron module} for every module a file binds to a name."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_module(full):
                    aliases[alias.asname or alias.name] = full
    return aliases


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _assigned_module_attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, attribute) for each data attribute of a megatron module that the file
    assigns: `module.NAME = ...`, `setattr(module, "NAME", ...)`,
    `monkeypatch.setattr(module, "NAME", ...)` where NAME is not a function or class,
    `module.NAME[key] = ...` and `monkeypatch.setitem(module.NAME, ...)`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _megatron_module_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                while isinstance(target, ast.Subscript):  # module.NAME[key] = ... changes NAME
                    target = target.value
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in aliases
                ):
                    found.append((node.lineno, aliases[target.value.id], target.attr))
        elif isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            first = node.args[0]
            if name.endswith("setitem") and isinstance(first, ast.Attribute):
                if isinstance(first.value, ast.Name) and first.value.id in aliases:
                    found.append((node.lineno, aliases[first.value.id], first.attr))
            elif name.endswith("setattr") and len(node.args) >= 2:
                attr = node.args[1]
                if (
                    isinstance(first, ast.Name)
                    and first.id in aliases
                    and isinstance(attr, ast.Constant)
                    and not _is_code(aliases[first.id], attr.value)
                ):
                    found.append((node.lineno, aliases[first.id], attr.value))
    return found


def _is_code(module: str, attribute: str) -> bool:
    """Whether module.attribute is a function or class (a spy may replace it)."""
    value = getattr(importlib.import_module(module), attribute, None)
    return callable(value)


def test_no_module_attribute_of_megatron_is_assigned_from_outside():
    files = [
        path
        for top in ("tests", "benchmarks", "dev")
        for path in sorted((REPO / top).rglob("*.py"))
        if path.name != "test_house_rules.py"
    ]
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}.{attribute}"
        for path in files
        for line, module, attribute in _assigned_module_attributes(path)
    ]
    assert found == [], "lab switches flipped from outside the product:\n" + "\n".join(found)


# ----- the layer table ------------------------------------------------------------------------


def may_import_table(text: str) -> dict[str, set[str]]:
    """{package: packages it may import} from ARCHITECTURE.md's table, whose rows are
    `| package | responsibility | may import |`, packages written as `megatron/...`."""
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`megatron"):
            package = cells[0].strip("`").rstrip("/").replace("/", ".")
            allowed = {
                c.strip().strip("`").rstrip("/").replace("/", ".") for c in cells[2].split(",")
            }
            table[package] = {a for a in allowed if a and a != "nothing"}
    return table


def _package_of(module: str, packages: list[str]) -> str | None:
    matches = [p for p in packages if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def test_packages_import_only_what_architecture_allows():
    table = may_import_table((REPO / "docs" / "ARCHITECTURE.md").read_text())
    packages = sorted(table)
    assert len(packages) >= 10, "ARCHITECTURE.md's may-import table was not found"
    modules = project_modules()
    covered = [m for m in modules if m.startswith("megatron.")]
    unlisted = [m for m in covered if _package_of(m, packages) is None]
    assert unlisted == [], f"modules of no listed package: {unlisted}"
    graph, in_function = import_graph(modules)
    by_file = {path.relative_to(REPO).as_posix(): module for module, path in modules.items()}
    edges = {(a, b) for a, targets in graph.items() for b in targets}
    edges |= {(by_file[file], target) for file, _, target in in_function}
    wrong = []
    for source, target in sorted(edges):
        if not source.startswith("megatron.") or not target.startswith("megatron."):
            continue
        a, b = _package_of(source, packages), _package_of(target.rstrip(".*"), packages)
        if a != b and b not in table[a]:
            wrong.append(f"{source} -> {target} ({a} may not import {b})")
    assert wrong == [], "\n".join(wrong)


def test_the_table_reader_and_the_package_lookup():
    text = (
        "| package | responsibility | may import |\n|---|---|---|\n"
        "| `megatron/core/` | leaves | nothing |\n"
        "| `megatron/core/fp8/` | FP8 | `megatron/core/` |\n"
    )
    table = may_import_table(text)
    assert table == {"megatron.core": set(), "megatron.core.fp8": {"megatron.core"}}
    packages = sorted(table)
    assert _package_of("megatron.core.fp8.cuda.launch", packages) == "megatron.core.fp8"
    assert _package_of("megatron.core.environment", packages) == "megatron.core"
    assert _package_of("megatron.training.training", packages) is None


def test_the_lab_switch_check_tells_a_value_from_a_spy(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(
        "import megatron.core.fp8.debug as debug\n"
        "debug.DEBUG = None\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(debug, 'DEBUG', None)\n"
        "    monkeypatch.setattr(debug, 'set_debug_config', print)\n"
        "    monkeypatch.setitem(debug.DEBUG, 'x', 1)\n"
        "    debug.DEBUG['tiles'] = {}\n"
    )
    found = _assigned_module_attributes(path)
    assert sorted(found) == [
        (2, "megatron.core.fp8.debug", "DEBUG"),
        (4, "megatron.core.fp8.debug", "DEBUG"),
        (6, "megatron.core.fp8.debug", "DEBUG"),
        (7, "megatron.core.fp8.debug", "DEBUG"),
    ]
