"""FP8 checkpoints in the layouts issues 38 and 40 added, on 4 gloo ranks, torch_dist: FP8
weights as parameters of Megatron-FSDP ZeRO-3 (--fp8-param-gather) with routed experts at EP 2
(issue 38) and at TP 2 x DP 2 with --sequence-parallel (issue 40), each recipe; and DDP with
experts at EP 2 under delayed scaling (its state in fp8_delayed_scaling.pt, written by rank 0
from every rank's experts).

A run of SAVE_AT + RESUMED steps saves at SAVE_AT; a second run loads that checkpoint in the
same layout: its losses equal the uninterrupted run's bitwise (FP8 bytes are not saved, they
are quantized again from the fp32 main params on load, as the uninterrupted run quantized
them after its step; the delayed-scaling histories of every expert and of every TP shard are
saved and restored). The EP 2 checkpoint also resumes at EP 4 (fp64 grad buffers on both
sides, so only the order of the expert segments' fp32 sums differs): within 1e-5, as
test_moe_fp8_params.py bounds EP 2 against EP 1; delayed scaling too, since every expert's
history is saved under its global expert index (each EP rank's distinct entries; before, the
checkpoint kept EP rank 0's experts' histories and a resume at the same layout was off by 8e-5
at its first step)."""

from __future__ import annotations

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel.test_tp_fp8_training import GPT as TP_GPT
from tests.unit_tests.tensor_parallel.test_tp_fp8_training import TP2_SP
from tests.unit_tests.training.common import run_pretrain
from tests.unit_tests.training.test_moe_training import TINY_MOE

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
SAVE_AT, TOTAL = 4, 8
FP8_PARAMS = [
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "optim_grads_params",
    "--fp8-param-gather",
    "--fp8-format", "hybrid",
    "--ckpt-format", "torch_dist",
    "--main-grads-dtype", "fp64",
]  # fmt: skip
MOE_GPT = [
    *TINY_MOE,
    "--train-iters", str(TOTAL),
    "--hidden-size", "128",
    "--moe-ffn-hidden-size", "128",
    "--moe-shared-expert-intermediate-size", "128",
    "--ffn-hidden-size", "128",
]  # fmt: skip
"""The tiny MoE GPT at widths whose experts hold whole 128x128 blocks (blockwise needs them)."""
MOE = MOE_GPT + FP8_PARAMS
DDP_MOE = MOE_GPT + ["--fp8-format", "hybrid", "--ckpt-format", "torch_dist"]
"""The same MoE GPT under DDP: FP8 compute on high-precision weights."""
TP = [*TP_GPT, *TP2_SP, "--ckpt-format", "torch_dist", "--train-iters", str(TOTAL)]


def _ep(size: int) -> list[str]:
    return ["--expert-model-parallel-size", str(size)]


def _save_and_resume(
    rank: int, world_size: int, argv: list[str], root: str, recipes=RECIPES
) -> dict:
    """Each recipe: the uninterrupted losses (saving at SAVE_AT) and a same-layout resume's."""
    results = {}
    for recipe in recipes:
        directory = f"{root}/{recipe}"
        run = argv + ["--fp8-recipe", recipe, "--save", directory]
        whole = run_pretrain(run + ["--save-interval", str(SAVE_AT)]).losses
        resumed = run_pretrain(run + ["--load", directory, "--ckpt-step", str(SAVE_AT)]).losses
        results[recipe] = {"whole": whole, "resumed": resumed}
    return results


def _resume(rank: int, world_size: int, argv: list[str], root: str, recipes) -> dict:
    return {
        recipe: run_pretrain(
            argv
            + ["--fp8-recipe", recipe, "--load", f"{root}/{recipe}", "--ckpt-step", str(SAVE_AT)]
        ).losses
        for recipe in recipes
    }


_RUNS: dict[str, object] = {}


@pytest.fixture(scope="module")
def moe_ep2(tmp_path_factory):
    if "moe" not in _RUNS:
        root = str(tmp_path_factory.mktemp("moe_fp8"))
        _RUNS["moe"] = (run_distributed(_save_and_resume, 4, MOE + _ep(2), root), root)
    return _RUNS["moe"]


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory):
    if "tp" not in _RUNS:
        root = str(tmp_path_factory.mktemp("tp_fp8"))
        _RUNS["tp"] = run_distributed(_save_and_resume, 4, TP, root)
    return _RUNS["tp"]


def _assert_resume_is_bitwise(per_rank: list[dict], recipe: str) -> None:
    for rank, results in enumerate(per_rank):
        whole, resumed = results[recipe]["whole"], results[recipe]["resumed"]
        assert sorted(whole) == list(range(1, TOTAL + 1)), rank
        assert whole[TOTAL] < whole[1], (rank, whole)  # it trains
        assert sorted(resumed) == list(range(SAVE_AT + 1, TOTAL + 1)), rank
        for iteration, loss in resumed.items():
            assert loss == whole[iteration], (recipe, rank, iteration, loss, whole[iteration])


@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_fp8_params_resume_bitwise(moe_ep2, recipe) -> None:
    _assert_resume_is_bitwise(moe_ep2[0], recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_tensor_parallel_fp8_params_resume_bitwise(tp2_dp2, recipe) -> None:
    _assert_resume_is_bitwise(tp2_dp2, recipe)


def test_expert_fp8_params_resume_at_another_expert_parallel_size(moe_ep2) -> None:
    per_rank, root = moe_ep2
    resumed = run_distributed(_resume, 4, MOE + _ep(4), root, RECIPES)[0]
    for recipe in RECIPES:
        whole = per_rank[0][recipe]["whole"]
        assert sorted(resumed[recipe]) == list(range(SAVE_AT + 1, TOTAL + 1))
        for iteration, loss in resumed[recipe].items():
            assert loss == pytest.approx(whole[iteration], abs=1e-5), (recipe, iteration)


def test_ddp_expert_delayed_scaling_resumes_at_any_expert_parallel_size(tmp_path) -> None:
    """Under DDP the delayed state is one file: it holds every EP rank's experts, so the
    resume is bitwise at EP 2 and within 1e-5 at EP 4 (before, rank 0 wrote its own experts'
    states only)."""
    root = str(tmp_path)
    argv = DDP_MOE + _ep(2)
    assert "--use-megatron-fsdp" not in argv and "--main-grads-dtype" not in argv
    per_rank = run_distributed(_save_and_resume, 4, argv, root, ("delayed",))
    _assert_resume_is_bitwise(per_rank, "delayed")
    resumed = run_distributed(_resume, 4, DDP_MOE + _ep(4), root, ("delayed",))[0]["delayed"]
    whole = per_rank[0]["delayed"]["whole"]
    assert sorted(resumed) == list(range(SAVE_AT + 1, TOTAL + 1))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(whole[iteration], abs=1e-5), iteration
