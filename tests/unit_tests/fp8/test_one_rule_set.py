"""Structure of the FP8 package: each format constant and quantization rule is defined in one
module, cuda/ defines none of them, and files and functions stay within the house limits."""

import ast
import pathlib

import megatron

ROOT = pathlib.Path(megatron.__file__).parent
FP8 = ROOT / "core" / "fp8"

# name -> the one module (relative to megatron/) that defines it.
ONE_DEFINITION = {
    "FP8_DTYPES": "core/fp8/formats.py",
    "FP8_MAX": "core/fp8/formats.py",
    "ROLES": "core/fp8/formats.py",
    "FLT_MAX": "core/fp8/formats.py",
    "fp8_max": "core/fp8/formats.py",
    "fp8_max_reciprocal": "core/fp8/formats.py",
    "check_fp8_dtype": "core/fp8/formats.py",
    "BLOCK_128": "core/fp8/recipe.py",
    "MX_BLOCK": "core/fp8/recipe.py",
    "scale_from_amax": "core/fp8/reference.py",
    "reciprocal": "core/fp8/reference.py",
    "saturating_cast": "core/fp8/reference.py",
    "amax_ignoring_nan": "core/numerics.py",
    "e8m0_from_amax": "core/fp8/reference.py",
    "check_quantize_args": "core/fp8/reference.py",
}


def _top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_each_fp8_rule_and_constant_is_defined_in_one_module():
    defined: dict[str, list[str]] = {name: [] for name in ONE_DEFINITION}
    for path in sorted(ROOT.rglob("*.py")):
        for name in _top_level_names(path) & set(ONE_DEFINITION):
            defined[name].append(str(path.relative_to(ROOT)))
    assert defined == {name: [module] for name, module in ONE_DEFINITION.items()}


def test_fp8_files_and_functions_stay_within_the_limits():
    too_long = []
    for path in sorted(FP8.rglob("*.py")):
        text = path.read_text()
        is_triton = path.name.startswith("triton_")
        if len(text.splitlines()) > (800 if is_triton else 600):
            too_long.append((path.name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
            if not jit and node.end_lineno - node.lineno + 1 > 80:
                too_long.append((path.name, node.name, node.end_lineno - node.lineno + 1))
    # linear.py is being split on another branch (issue 35); only the files of this rule set
    # are checked strictly.
    assert [entry for entry in too_long if entry[0] != "linear.py"] == []
