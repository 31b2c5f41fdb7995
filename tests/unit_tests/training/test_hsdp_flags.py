"""HSDP flags: bad layouts stop at parse time with exit 2 and a message naming the fix."""

from __future__ import annotations

import pytest

from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import build_fsdp_config
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)

FSDP = ["--use-megatron-fsdp"]


def _instances(n: int) -> list[str]:
    return ["--num-distributed-optimizer-instances", str(n)]


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        # N does not divide the world size.
        (
            FSDP + _instances(3),
            4,
            "--num-distributed-optimizer-instances 3 does not divide the data-parallel size 4; "
            "pick a divisor of 4",
        ),
        (FSDP + _instances(0), 4, "--num-distributed-optimizer-instances 0 must be >= 1"),
        # HSDP without Megatron-FSDP.
        (_instances(2), 4, "Megatron-FSDP's sharded state; add --use-megatron-fsdp."),
        (["--outer-dp-sharding-strategy", "optim"] + _instances(2), 4, "add --use-megatron-fsdp"),
        # Outer optim with an inner strategy that does not shard the optimizer.
        (
            FSDP
            + _instances(2)
            + [
                "--outer-dp-sharding-strategy",
                "optim",
                "--data-parallel-sharding-strategy",
                "no_shard",
            ],
            4,
            "--outer-dp-sharding-strategy optim splits the optimizer state across replicas, but "
            "--data-parallel-sharding-strategy no_shard does not shard it inside one; use "
            "--data-parallel-sharding-strategy optim_grads_params",
        ),
        # Replicas of nothing sharded.
        (
            FSDP + _instances(2) + ["--data-parallel-sharding-strategy", "no_shard"],
            4,
            "--data-parallel-sharding-strategy no_shard shards nothing; use optim_grads_params",
        ),
        # Outer optim without replicas.
        (
            FSDP + ["--outer-dp-sharding-strategy", "optim"],
            4,
            "add --num-distributed-optimizer-instances N (N > 1",
        ),
        (
            FSDP + _instances(2) + ["--outer-dp-sharding-strategy", "zero3"],
            4,
            "invalid choice: 'zero3'",
        ),
    ],
)
def test_bad_hsdp_layouts_exit_2(extra, world_size, expected, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_GPT + extra, world_size=world_size)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("error:") == 1


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_valid_hsdp_layout_reaches_the_fsdp_config(outer: str) -> None:
    argv = TINY_GPT + FSDP + _instances(2) + ["--outer-dp-sharding-strategy", outer]
    args = parse_args(argv, world_size=4)
    assert args.num_distributed_optimizer_instances == 2
    assert build_fsdp_config(args).outer_dp_sharding_strategy == outer
    # Megatron-LM's defaults: one instance, outer no_shard.
    defaults = parse_args(TINY_GPT + FSDP, world_size=4)
    assert defaults.num_distributed_optimizer_instances == 1
    assert build_fsdp_config(defaults).outer_dp_sharding_strategy == "no_shard"


def test_pretrain_hsdp_2x2_matches_one_process_and_resumes_in_one(tmp_path) -> None:
    """pretrain_gpt.py's path: the mesh from the flags, HSDP 2 x 2 with outer optim, saved at
    iteration 3 and resumed in one process (plain ZeRO-3 over one rank)."""
    argv = TINY_GPT + NO_DROPOUT + FSDP + ["--train-iters", "6"]
    uninterrupted = run_pretrain(argv).losses
    hsdp = _instances(2) + ["--outer-dp-sharding-strategy", "optim"]
    save = ["--save", str(tmp_path), "--exit-interval", "3"]
    per_rank = run_distributed(run_pretrain_on_rank, 4, argv + hsdp + save)
    for losses in per_rank:
        assert sorted(losses) == [1, 2, 3]
        for iteration, loss in losses.items():
            assert loss == pytest.approx(uninterrupted[iteration], rel=1e-5), iteration
    resumed = run_pretrain(argv + ["--load", str(tmp_path)]).losses
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[iteration], rel=1e-5), iteration
