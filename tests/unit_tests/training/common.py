"""A tiny GPT on mock data: the flags every training test starts from."""

from __future__ import annotations

TINY_GPT = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "512",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--lr",
    "1e-3",
    "--seed",
    "1234",
]

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# Megatron-FSDP ZeRO-3 saving sharded fsdp_dtensor checkpoints.
ZERO3_DTENSOR = [
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--ckpt-format",
    "fsdp_dtensor",
]


def run_pretrain(argv: list[str]):
    """pretrain() in this process (fast: no interpreter start)."""
    from megatron.training.training import pretrain

    return pretrain(argv)


def run_pretrain_on_rank(rank: int, world_size: int, argv: list[str]) -> dict[int, float]:
    """For tests/unit_tests/dist_utils.run_distributed: losses by iteration on every rank."""
    return run_pretrain(argv).losses


def eager_and_compiled(argv: list[str]) -> dict:
    """One eager and one `--torch-compile` run of argv: their losses, and dynamo's graph breaks
    (reason -> count) and unique graphs during the compiled run (counters reset around it)."""
    import torch
    from torch._dynamo.utils import counters

    eager = run_pretrain(argv).losses
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = run_pretrain([*argv, "--torch-compile"]).losses
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    return dict(eager=eager, compiled=compiled, breaks=breaks, graphs=graphs)


def eager_and_compiled_on_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    """`eager_and_compiled` for tests/unit_tests/dist_utils.run_distributed."""
    return eager_and_compiled(argv)
