"""--use-torch-fsdp2 (PyTorch's fully_shard) with checkpoints, and what it refuses (issue 36).

FSDP2 saves `--ckpt-format torch_dist` (its default; Megatron-LM requires it too) in the layout
of Megatron-FSDP and DDP: each parameter and Adam moment flattened to 1-D, every rank writing
its rows as one contiguous piece. A resume gives the uninterrupted run's next losses exactly at
1 and 2 gloo ranks, and a checkpoint of either engine continues under the other (and FSDP2's at
another data-parallel size) within 1e-6. --fp16 under FSDP2 is refused as Megatron-LM refuses
it, and the run's model returns its loss as a tensor of its own (no FSDP2 view warning).
"""

from __future__ import annotations

import json
import warnings

import pytest

from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    run_pretrain,
    run_pretrain_on_rank,
)

SAVE_AT, TOTAL = 3, 6
BASE = TINY_GPT + NO_DROPOUT + ["--train-iters", str(TOTAL)]
FSDP2 = ["--use-torch-fsdp2"]
MEGATRON_FSDP = ["--use-megatron-fsdp"]
RESUMED = list(range(SAVE_AT + 1, TOTAL + 1))


def _losses(world_size: int, argv: list[str]) -> dict[int, float]:
    if world_size == 1:
        return run_pretrain(argv).losses
    return run_distributed(run_pretrain_on_rank, world_size, argv)[0]


def _save(directory, world_size: int, engine: list[str]) -> dict[int, float]:
    """The uninterrupted run, which saves at SAVE_AT (and at TOTAL)."""
    argv = BASE + engine + ["--save", str(directory), "--save-interval", str(SAVE_AT)]
    return _losses(world_size, argv)


def _resume(directory, world_size: int, engine: list[str]) -> dict[int, float]:
    argv = BASE + engine + ["--load", str(directory), "--ckpt-step", str(SAVE_AT)]
    return _losses(world_size, argv)


@pytest.fixture(scope="module")
def fsdp2_at_two_ranks(tmp_path_factory):
    """An FSDP2 run at 2 ranks with its checkpoint: (directory, its losses)."""
    directory = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    return directory, _save(directory, 2, FSDP2)


def _check_layout(directory, world_size: int) -> None:
    iteration = directory / f"iter_{SAVE_AT:07d}"
    metadata = json.loads((iteration / "metadata.json").read_text())
    assert metadata["ckpt_format"] == "torch_dist" and metadata["world_size"] == world_size
    shards = sorted(path.name for path in (iteration / "sharded").iterdir())
    assert shards == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(world_size)]


def test_fsdp2_resume_at_one_rank_is_exact(tmp_path):
    uninterrupted = _save(tmp_path / "ckpt", 1, FSDP2)
    _check_layout(tmp_path / "ckpt", 1)
    resumed = _resume(tmp_path / "ckpt", 1, FSDP2)
    assert resumed == {i: uninterrupted[i] for i in RESUMED}  # bitwise: nothing else differs


def test_fsdp2_resume_at_two_ranks_is_exact(fsdp2_at_two_ranks):
    directory, uninterrupted = fsdp2_at_two_ranks
    _check_layout(directory, 2)
    resumed = _resume(directory, 2, FSDP2)
    assert resumed == {i: uninterrupted[i] for i in RESUMED}
    assert uninterrupted[TOTAL] < uninterrupted[1]  # it trains at all


def _assert_continues(resumed: dict[int, float], uninterrupted: dict[int, float]) -> None:
    assert sorted(resumed) == RESUMED
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[iteration], rel=1e-6, abs=0), iteration


@pytest.mark.parametrize(
    "world_size, engine", [(2, MEGATRON_FSDP), (1, FSDP2)], ids=["megatron-fsdp", "fsdp2-dp1"]
)
def test_fsdp2_checkpoint_resumes_under_megatron_fsdp_and_at_one_rank(
    fsdp2_at_two_ranks, world_size, engine
):
    directory, uninterrupted = fsdp2_at_two_ranks
    _assert_continues(_resume(directory, world_size, engine), uninterrupted)


def test_megatron_fsdp_checkpoint_resumes_under_fsdp2(tmp_path):
    uninterrupted = _save(tmp_path / "ckpt", 2, MEGATRON_FSDP)
    _assert_continues(_resume(tmp_path / "ckpt", 2, FSDP2), uninterrupted)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--fp16"],
            "--use-torch-fsdp2 does not go with --fp16 here (Megatron-LM refuses it with the "
            "distributed optimizer, and with fp16: '--use-torch-fsdp2 not supported with fp16 "
            "yet'",
        ),
        (["--ckpt-format", "torch"], "--use-torch-fsdp2 saves sharded checkpoints: drop"),
    ],
    ids=["fp16", "ckpt-format-torch"],
)
def test_refused_in_one_line(extra, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        pretrain(BASE + FSDP2 + extra + ["--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("error:") == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert expected in line


def test_fsdp2_training_warns_nothing_about_views():
    """The loss GPTModel returns is not a view (FSDP2 warned once per micro-batch that an
    in-place op on its root module's view output would drop its backward hook). The losses
    are the model's: the first bitwise that of the same model under DDP (same weights, same
    batch), the second (after one update by each engine's own optimizer path) close to it.
    (It once compared with literals, which held only on the host that recorded them.)"""
    argv = TINY_GPT + NO_DROPOUT + ["--train-iters", "2", "--bf16"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = run_pretrain(argv + FSDP2).losses
    messages = [str(warning.message) for warning in caught]
    assert not [message for message in messages if "view" in message], messages
    ddp = run_pretrain(argv).losses
    assert losses[1] == ddp[1] and losses[2] == pytest.approx(ddp[2], rel=1e-3)
    assert losses[2] < losses[1]


def test_fsdp2_bf16_async_save_resumes_exactly(tmp_path):
    """The functional case's other flags, without --fp16: --bf16 compute, --async-save."""
    engine = FSDP2 + ["--bf16", "--async-save"]
    uninterrupted = _save(tmp_path / "ckpt", 2, engine)
    resumed = _resume(tmp_path / "ckpt", 2, FSDP2 + ["--bf16"])
    assert resumed == {i: uninterrupted[i] for i in RESUMED}
