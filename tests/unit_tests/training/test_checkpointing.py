"""Checkpoint round trip, exact resume, atomic writes and clear errors for bad checkpoints."""

import json
import os
import pickle

import pytest
import torch

from megatron.training.checkpointing import CheckpointError, load_state_for_export
from tests.unit_tests.training.common import TINY_GPT, run_pretrain

ITERS = ["--train-iters", "40"]


def test_resume_continues_exactly(tmp_path):
    """Stop at 20, resume to 40: losses 21..40 equal the uninterrupted run exactly (dropout on)."""
    full = run_pretrain(TINY_GPT + ITERS)
    save = ["--save", str(tmp_path), "--exit-interval", "20"]
    first = run_pretrain(TINY_GPT + ITERS + save)
    assert sorted(first.losses) == list(range(1, 21))
    second = run_pretrain(TINY_GPT + ITERS + ["--load", str(tmp_path)])
    assert sorted(second.losses) == list(range(21, 41))
    for iteration in range(21, 41):
        assert second.losses[iteration] == full.losses[iteration]
    assert second.state.consumed_train_samples == 40 * 8


def test_layout_and_atomicity(tmp_path):
    run_pretrain(TINY_GPT + ["--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2"])
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]  # no *.tmp directory or tracker left behind
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read() == "4\n"
    directory = tmp_path / "iter_0000004"
    assert sorted(os.listdir(directory)) == ["metadata.json", "model.pt", "optimizer.pt", "rng"]
    metadata = json.load(open(directory / "metadata.json"))
    assert metadata["iteration"] == 4 and metadata["consumed_train_samples"] == 32
    state, config = load_state_for_export(str(tmp_path))
    assert config.hidden_size == 64 and config.vocab_size == 512
    assert state["embedding.word_embeddings.weight"].shape == (512, 64)
    assert all(tensor.dtype == torch.float32 for tensor in state.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    run_pretrain(TINY_GPT + ["--train-iters", "2", "--save", str(root)])
    return root


def _copy(saved, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def _load_error(root, extra=()) -> str:
    with pytest.raises(CheckpointError) as info:
        run_pretrain(TINY_GPT + ["--train-iters", "4", "--load", str(root), *extra])
    return str(info.value)


def test_truncated_model_file(saved, tmp_path):
    root = _copy(saved, tmp_path)
    path = root / "iter_0000002" / "model.pt"
    path.write_bytes(path.read_bytes()[:100])
    message = _load_error(root)
    assert "model.pt: cannot be read" in message and "truncated" in message


def test_foreign_checkpoint(saved, tmp_path):
    root = _copy(saved, tmp_path)
    meta = root / "iter_0000002" / "metadata.json"
    meta.write_text(json.dumps({"format": "something-else"}))
    assert "was written by another program" in _load_error(root)


def test_missing_metadata(saved, tmp_path):
    root = _copy(saved, tmp_path)
    os.remove(root / "iter_0000002" / "metadata.json")
    assert "no metadata.json" in _load_error(root)


def test_bad_tracker(saved, tmp_path):
    root = _copy(saved, tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert "expected an iteration number" in _load_error(root)


def test_architecture_mismatch(saved):
    message = _load_error(saved, ["--num-layers", "3"])
    assert "saved with --num-layers 2, but this run has 3" in message


class _Payload:
    def __reduce__(self):
        return (os.makedirs, ("/tmp/megatron_fp8_pwned_by_checkpoint",))


def test_untrusted_pickle_is_not_executed(saved, tmp_path):
    root = _copy(saved, tmp_path)
    with open(root / "iter_0000002" / "model.pt", "wb") as handle:
        pickle.dump({"x": _Payload()}, handle)
    marker = "/tmp/megatron_fp8_pwned_by_checkpoint"
    if os.path.isdir(marker):
        os.rmdir(marker)
    assert "cannot be read" in _load_error(root)
    assert not os.path.exists(marker)


def test_no_load_optim_and_finetune(saved):
    finetune = run_pretrain(TINY_GPT + ["--train-iters", "2", "--load", str(saved), "--finetune"])
    assert sorted(finetune.losses) == [1, 2]  # iteration counter reset
    resumed = run_pretrain(
        TINY_GPT + ["--train-iters", "3", "--load", str(saved), "--no-load-optim"]
    )
    assert sorted(resumed.losses) == [3]


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_fp8_resume_continues_exactly(tmp_path, recipe):
    """Delayed scaling's scales and amax histories travel with the checkpoint: without them
    the resumed losses differ (the first resumed forward would quantize with scale 1)."""
    argv = TINY_GPT + ["--train-iters", "8", "--fp8-recipe", recipe, "--fp8-amax-history-len", "4"]
    full = run_pretrain(argv)
    run_pretrain(argv + ["--save", str(tmp_path), "--exit-interval", "4"])
    has_state = os.path.isfile(tmp_path / "iter_0000004" / "fp8_delayed_scaling.pt")
    assert has_state == (recipe == "delayed")
    resumed = run_pretrain(argv + ["--load", str(tmp_path)])
    assert [resumed.losses[i] for i in range(5, 9)] == [full.losses[i] for i in range(5, 9)]
