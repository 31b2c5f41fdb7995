"""Issue 38, acceptance 1 (FP8 part, partly met): the tiny MoE GPT of test_moe_training.py
trained 20 steps with an FP8 recipe on 4 gloo ranks under Megatron-FSDP ZeRO-3, at
expert-parallel size 2 vs the same recipe at EP 1. The routed experts' GEMMs run in FP8
(Fp8StackedLinear), each expert on its own scales and each source rank's tokens quantized on
their own, so the EP layout changes only the order of the fp32 sums of expert weight grads
(local sum of segments, then the expert-data-parallel reduction). The first steps are within
1e-5 (measured: tensorwise bitwise equal for 9 steps); once that fp32 order flips one FP8
rounding the runs drift apart like any two FP8 runs (measured: up to 1.5e-4 by step 20), so
the 20 steps are held to a looser bound. Making the 20 steps agree within 1e-5 needs the expert
wgrad reduction in one fixed order at every layout (not built)."""

from __future__ import annotations

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_moe_training import TINY_MOE, ZERO3, _losses_on_rank

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
EXACT_STEPS = 5
"""Steps before any fp32 sum-order difference can reach an FP8 rounding (held to 1e-5)."""
DRIFT = 1e-3
"""Bound of the later steps: FP8 rounding flips from fp32 sum order (measured <= 1.5e-4)."""


def _fp8_losses(world_size: int, ep_size: int, recipe: str) -> list[list[float]]:
    argv = [
        *TINY_MOE,
        *ZERO3,
        "--fp8-recipe", recipe,
        "--fp8-format", "hybrid",
        "--expert-model-parallel-size", str(ep_size),
    ]  # fmt: skip
    return run_distributed(_losses_on_rank, world_size, argv)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_experts_ep2_equal_ep1(recipe):
    reference = _fp8_losses(4, 1, recipe)
    assert reference[0][-1] < reference[0][0] - 0.3  # it learns in FP8 too
    first = reference[0][:EXACT_STEPS]
    for rank_losses in _fp8_losses(4, 2, recipe):
        assert rank_losses[:EXACT_STEPS] == pytest.approx(first, rel=1e-5, abs=0)
        assert rank_losses == pytest.approx(reference[0], rel=DRIFT, abs=0)
