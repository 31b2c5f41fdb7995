"""RecipeSpec against FP8_NUMERICS.md, and no recipe-name comparison below the config layer."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron.core.fp8 import E4M3, Fp8Config, quantize
from megatron.core.fp8.recipe import (
    BLOCK_128,
    FP8_RECIPES,
    MX_BLOCK,
    RECIPE_SPECS,
    is_recipe,
    recipe_spec,
)
from megatron.core.fp8.reference import scale_grid_shape

FLT_MAX = 3.4028234663852886e38
ROLES = ("input", "weight", "grad")


def _cells(name: str) -> dict[tuple[str, bool], tuple[int, int] | None]:
    spec = recipe_spec(name)
    return {
        (role, columnwise): spec.block_shape(role, columnwise=columnwise)
        for role in ROLES
        for columnwise in (False, True)
    }


def test_table_holds_the_four_recipes_in_flag_order():
    assert tuple(RECIPE_SPECS) == FP8_RECIPES == ("delayed", "tensorwise", "blockwise", "mxfp8")
    assert [spec.name for spec in RECIPE_SPECS.values()] == list(FP8_RECIPES)
    assert all(recipe_spec(name) is RECIPE_SPECS[name] for name in FP8_RECIPES)
    assert [is_recipe(name) for name in ("mxfp8", "MXFP8", "fp8", None)] == [
        True,
        False,
        False,
        False,
    ]


def test_unknown_recipe_fails_naming_the_choices():
    with pytest.raises(ValueError, match=r"recipe must be one of \('delayed'.*got 'nvfp4'"):
        recipe_spec("nvfp4")
    with pytest.raises(ValueError, match="recipe must be one of"):
        recipe_spec(["mxfp8"])


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe_spec("tensorwise").per_tensor = False


@pytest.mark.parametrize("name", ["delayed", "tensorwise"])
def test_per_tensor_recipes(name):
    spec = recipe_spec(name)
    assert (spec.per_tensor, spec.block, spec.e8m0_scales) == (True, 0, False)
    assert set(_cells(name).values()) == {None}
    assert spec.scale_dtype == torch.float32
    # Backward reads the transpose of the rowwise bytes for every role: no columnwise copy.
    assert [spec.transposes_rowwise(r) for r in ROLES] == [True, True, True]
    assert [spec.columnwise_copy(r) for r in ROLES] == [False, False, False]
    assert spec.fast_accumulation is True
    assert spec.infinite_scale_value(torch.bfloat16) == FLT_MAX
    assert spec.power_2_default is False
    caps = [(8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
    assert [spec.hardware_gemm(c) for c in caps] == [False, True, True, True, True]
    assert spec.fused_linear_emulates is False


def test_delayed_and_tensorwise_differ_in_state_amax_and_rounding():
    delayed, tensorwise = recipe_spec("delayed"), recipe_spec("tensorwise")
    assert (delayed.delayed, delayed.accepts_global_amax, delayed.power_2_configurable) == (
        True,
        False,
        False,
    )
    assert (
        tensorwise.delayed,
        tensorwise.accepts_global_amax,
        tensorwise.power_2_configurable,
    ) == (False, True, True)


def test_blockwise():
    spec = recipe_spec("blockwise")
    assert (spec.per_tensor, spec.delayed, spec.block, spec.e8m0_scales) == (
        False,
        False,
        128,
        False,
    )
    assert _cells("blockwise") == {
        ("input", False): (1, 128),
        ("input", True): (128, 1),
        ("weight", False): (128, 128),
        ("weight", True): (128, 128),
        ("grad", False): (1, 128),
        ("grad", True): (128, 1),
    }
    assert spec.scale_dtype == torch.float32
    # 128x128 weights: the transpose cache; 1x128 activations and grads: a columnwise copy.
    assert [spec.columnwise_copy(r) for r in ROLES] == [True, False, True]
    assert spec.fast_accumulation is False
    assert spec.infinite_scale_value(torch.float32) == FLT_MAX
    assert spec.infinite_scale_value(torch.bfloat16) == 3.3895313892515355e38
    assert spec.infinite_scale_value(torch.float16) == 65504.0
    assert (spec.power_2_default, spec.power_2_configurable, spec.accepts_global_amax) == (
        True,
        True,
        False,
    )
    caps = [(8, 9), (9, 0), (9, 1), (10, 0), (12, 0)]
    assert [spec.hardware_gemm(c) for c in caps] == [False, True, True, False, False]
    assert spec.fused_linear_emulates is False


def test_mxfp8():
    spec = recipe_spec("mxfp8")
    assert (spec.per_tensor, spec.delayed, spec.block, spec.e8m0_scales) == (False, False, 32, True)
    for role in ROLES:  # 1x32 rowwise and 32x1 columnwise for weights too
        assert _cells("mxfp8")[(role, False)] == (1, 32)
        assert _cells("mxfp8")[(role, True)] == (32, 1)
    assert spec.scale_dtype == torch.uint8
    assert [spec.columnwise_copy(r) for r in ROLES] == [True, True, True]
    assert spec.fast_accumulation is False
    assert (spec.power_2_default, spec.power_2_configurable, spec.accepts_global_amax) == (
        True,
        False,
        False,
    )
    caps = [(8, 9), (9, 0), (10, 0), (12, 0)]
    assert [spec.hardware_gemm(c) for c in caps] == [False, False, True, True]
    assert spec.fused_linear_emulates is True


def test_block_lengths_match_the_kernel_constants():
    assert recipe_spec("blockwise").block == BLOCK_128 == 128
    assert recipe_spec("mxfp8").block == MX_BLOCK == 32


@pytest.mark.parametrize(
    ("name", "role", "columnwise", "grid"),
    [
        ("tensorwise", "weight", False, ()),
        ("blockwise", "weight", False, (3, 2)),
        ("blockwise", "weight", True, (3, 2)),
        ("blockwise", "input", False, (300, 2)),
        ("blockwise", "grad", True, (3, 200)),
        ("mxfp8", "weight", False, (300, 7)),
        ("mxfp8", "weight", True, (10, 200)),
    ],
)
def test_quantized_scales_have_the_spec_grid_and_dtype(name, role, columnwise, grid):
    assert scale_grid_shape(300, 200, recipe=name, role=role, columnwise=columnwise) == grid
    x = torch.randn(300, 200)
    qt = quantize(x, recipe=name, fp8_dtype=E4M3, role=role, rowwise=True, columnwise=True)
    scale_inv = qt.columnwise_scale_inv if columnwise else qt.rowwise_scale_inv
    assert tuple(scale_inv.shape) == grid
    assert scale_inv.dtype == recipe_spec(name).scale_dtype
    operand = qt.gemm_operand("rowwise")
    cell = recipe_spec(name).block_shape(role, columnwise=False)
    assert (operand.block_rows, operand.block_cols) == (cell or (0, 0))


@pytest.mark.parametrize(
    ("name", "power_2_scale", "passed", "used"),
    [
        ("delayed", None, None, False),
        ("delayed", True, None, False),
        ("tensorwise", None, False, False),
        ("tensorwise", True, True, True),
        ("blockwise", None, True, True),
        ("blockwise", False, False, False),
        ("mxfp8", None, None, True),
        ("mxfp8", False, None, True),
    ],
)
def test_config_power_2_scale(name, power_2_scale, passed, used):
    config = Fp8Config(recipe=name, power_2_scale=power_2_scale)
    assert config.spec is recipe_spec(name)
    assert config.quantize_power_2_scale is passed
    assert config.spec.resolve_power_2_scale(config.quantize_power_2_scale) is used


# ---- no recipe-name comparison below the config layer --------------------------------------

REPO = Path(__file__).resolve().parents[3]
CONFIG_LAYER = ("megatron/core/fp8/config.py", "megatron/core/fp8/recipe.py")
ALLOWED: Counter = Counter()
"""Comparisons allowed below the config layer, by (file, source text): none. Flag values
(`--fp8-recipe`, also as saved in checkpoint metadata) go through
`recipe.names_delayed_scaling`."""
_TESTS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _names_a_recipe(node: ast.expr) -> bool:
    """A recipe name literal, a tuple/list/set of them, or a variable or attribute whose name
    says it holds recipe names (recipe, fp8_recipe, FP8_RECIPES, PER_TENSOR...)."""
    if isinstance(node, ast.Constant):
        return node.value in FP8_RECIPES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_recipe(element) for element in node.elts)
    identifier = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    if not isinstance(identifier, str):
        return False
    lowered = identifier.lower()
    # A spec (recipe_spec, RecipeSpec-valued) is what code should compare, not a name.
    names_recipes = "recipe" in lowered and not lowered.endswith("spec")
    return names_recipes or identifier.startswith("PER_TENSOR")


def recipe_comparisons(source: str) -> list[str]:
    """Source text of every ==, !=, in, not in test that involves a recipe name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not all(isinstance(op, _TESTS) for op in node.ops):
            continue
        if any(_names_a_recipe(operand) for operand in (node.left, *node.comparators)):
            found.append(ast.get_source_segment(source, node))
    return found


def test_the_checker_finds_each_form_of_recipe_test():
    source = (
        'if recipe == "mxfp8": pass\n'
        "if qt.recipe in PER_TENSOR: pass\n"
        'if "blockwise" != name: pass\n'
        'ok = kind in ("delayed", "tensorwise")\n'
        "bad = name not in FP8_RECIPES\n"
        "same = a.recipe != b.recipe\n"
        "for recipe in FP8_RECIPES: pass\n"
        'fine = role == "weight" and spec.per_tensor and a.spec != b.spec\n'
    )
    assert recipe_comparisons(source) == [
        'recipe == "mxfp8"',
        "qt.recipe in PER_TENSOR",
        '"blockwise" != name',
        'kind in ("delayed", "tensorwise")',
        "name not in FP8_RECIPES",
        "a.recipe != b.recipe",
    ]


def test_no_recipe_name_comparisons_below_the_config_layer():
    found = Counter()
    for path in sorted((REPO / "megatron").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative in CONFIG_LAYER or relative.startswith("megatron/training/argument"):
            continue
        for text in recipe_comparisons(path.read_text()):
            found[(relative, text)] += 1
    unexpected = found - ALLOWED
    assert not unexpected, (
        "recipe names compared below the config layer; read a RecipeSpec attribute instead "
        f"(megatron/core/fp8/recipe.py): {sorted(unexpected.elements())}"
    )
