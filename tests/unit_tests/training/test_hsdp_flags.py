"""HSDP flags: bad layouts stop at parse time with exit 2 and a message naming the fix."""

from __future__ import annotations

import pytest

from megatron.training.arguments import parse_args
from megatron.training.configs import build_fsdp_config
from tests.unit_tests.training.common import TINY_GPT

FSDP = ["--use-megatron-fsdp"]


def _instances(n: int) -> list[str]:
    return ["--num-distributed-optimizer-instances", str(n)]


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        # N does not divide the world size.
        (FSDP + _instances(3), 4,
         "--num-distributed-optimizer-instances 3 does not divide the data-parallel size 4; "
         "pick a divisor of 4"),
        (FSDP + _instances(0), 4, "--num-distributed-optimizer-instances 0 must be >= 1"),
        # HSDP without Megatron-FSDP.
        (_instances(2), 4, "Megatron-FSDP's sharded state; add --use-megatron-fsdp."),
        (["--outer-dp-sharding-strategy", "optim"] + _instances(2), 4,
         "add --use-megatron-fsdp"),
        # Outer optim with an inner strategy that does not shard the optimizer.
        (FSDP + _instances(2) + ["--outer-dp-sharding-strategy", "optim",
                                 "--data-parallel-sharding-strategy", "no_shard"], 4,
         "--outer-dp-sharding-strategy optim splits the optimizer state across replicas, but "
         "--data-parallel-sharding-strategy no_shard does not shard it inside one; use "
         "--data-parallel-sharding-strategy optim_grads_params"),
        # Replicas of nothing sharded.
        (FSDP + _instances(2) + ["--data-parallel-sharding-strategy", "no_shard"], 4,
         "--data-parallel-sharding-strategy no_shard shards nothing; use optim_grads_params"),
        # Outer optim without replicas.
        (FSDP + ["--outer-dp-sharding-strategy", "optim"], 4,
         "add --num-distributed-optimizer-instances N (N > 1"),
        (FSDP + _instances(2) + ["--outer-dp-sharding-strategy", "zero3"], 4,
         "invalid choice: 'zero3'"),
    ],
)  # fmt: skip
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
