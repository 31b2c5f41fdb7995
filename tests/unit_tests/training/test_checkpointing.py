"""Checkpoint round trip, exact resume, atomic writes and clear errors for bad checkpoints."""

import json
import os
import pickle

import pytest
import torch

from megatron.training.checkpoint import CheckpointError, load_state_for_export
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
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    directory = tmp_path / "iter_0000004"
    assert sorted(os.listdir(directory)) == ["metadata.json", "model.pt", "optimizer.pt", "rng"]
    metadata = json.loads((directory / "metadata.json").read_text())
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


def test_every_architecture_mismatch_in_one_message(saved):
    wrong = ["--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "64"]
    message = _load_error(saved, wrong)
    assert (
        "saved with --num-layers 2, but this run has 3; --hidden-size 64, but this run has 32; "
        "--ffn-hidden-size 256, but this run has 64; --kv-channels 16, but this run has 8; "
        "use the checkpoint's values (or --use-checkpoint-args to take them all)."
    ) in message


class _Payload:
    def __reduce__(self):
        return (os.makedirs, ("/tmp/megatron_fp8_pwned_by_checkpoint",))


def test_untrusted_pickle_is_not_executed(saved, tmp_path):
    root = _copy(saved, tmp_path)
    with open(root / "iter_0000002" / "model.pt", "wb") as handle:
        pickle.dump({"x": _Payload()}, handle, protocol=2)  # torch.save's protocol: no warning
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


class _Killed(BaseException):
    """Stands in for SIGKILL: no `except Exception` in the save path can swallow it."""


def _kill_on_rename_into(monkeypatch, final: str) -> None:
    """Kill the process at the rename that would put `final` in place."""
    import megatron.core.checkpoint_files as checkpoint_files

    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(dst) == final and os.fspath(src).endswith(".tmp"):
            raise _Killed
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "replace", replace)


def test_killed_resave_leaves_the_previous_copy_loadable(tmp_path, monkeypatch, capsys):
    """Re-saving iteration 2, killed after the old copy moved aside and before the new one took
    its place: the old copy (complete) is what the tracker's iteration loads from, and the next
    save of that iteration puts everything back under the final name."""
    argv = TINY_GPT + ["--train-iters", "3", "--save", str(tmp_path), "--exit-interval", "2"]
    full = run_pretrain(TINY_GPT + ["--train-iters", "3"])
    run_pretrain(argv)
    final = str(tmp_path / "iter_0000002")
    with monkeypatch.context() as patch:
        _kill_on_rename_into(patch, final)
        with pytest.raises(_Killed):
            run_pretrain(argv)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000002.old",
        "iter_0000002.tmp",
        "latest_checkpointed_iteration.txt",
    ]
    assert sorted(os.listdir(tmp_path / "iter_0000002.old")) == [
        "metadata.json",
        "model.pt",
        "optimizer.pt",
        "rng",
    ]
    capsys.readouterr()
    resumed = run_pretrain(TINY_GPT + ["--train-iters", "3", "--load", str(tmp_path)])
    assert f" > loaded checkpoint {final}.old (iteration 2)" in capsys.readouterr().out
    assert resumed.losses == {3: full.losses[3]}
    run_pretrain(argv)  # re-save: the aside copy is restored, replaced, then deleted
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_publish_dir_keeps_one_complete_copy(tmp_path):
    from megatron.core.checkpoint_files import publish_dir, resolve_published_dir

    final = tmp_path / "iter"
    for name, text in (("iter.tmp", "new"), ("iter.old", "stale")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_text(text)
    (final).mkdir()
    (final / "data").write_text("old")
    publish_dir(tmp_path / "iter.tmp", final)  # final and a stale aside both exist
    assert sorted(os.listdir(tmp_path)) == ["iter"]
    assert (final / "data").read_text() == "new"
    os.rename(final, tmp_path / "iter.old")  # as a kill between the renames leaves it
    assert resolve_published_dir(final) == f"{final}.old"
    (tmp_path / "iter.tmp").mkdir()
    (tmp_path / "iter.tmp" / "data").write_text("newer")
    publish_dir(tmp_path / "iter.tmp", final)
    assert sorted(os.listdir(tmp_path)) == ["iter"]
    assert (final / "data").read_text() == "newer"
    assert resolve_published_dir(tmp_path / "absent") is None


def test_every_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """The data, then the directory entries, reach the disk before the rename that publishes
    them; the parent directory after it (so the rename itself survives a power loss)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run_pretrain(TINY_GPT + ["--train-iters", "2", "--save", str(tmp_path)])
    final = str(tmp_path / "iter_0000002")
    publish = events.index(("replace", f"{final}.tmp", final))
    synced_before = set()  # paths whose data is durable; a rename carries that to its target
    for event in events[:publish]:
        if event[0] == "fsync":
            synced_before.add(event[1])
        elif event[1] in synced_before:
            synced_before.add(event[2])
    written = {f"{final}.tmp"}
    for directory, _, files in os.walk(final):
        written.add(directory.replace(final, f"{final}.tmp", 1))
        written.update(
            os.path.join(directory, name).replace(final, f"{final}.tmp", 1) for name in files
        )
    assert len(written) == 6  # tmp, rng/, metadata.json, model.pt, optimizer.pt, rank_00000.pt
    assert written <= synced_before
    tracker = str(tmp_path / "latest_checkpointed_iteration.txt")
    after = events[publish + 1 :]
    assert after[0] == ("fsync", str(tmp_path))
    assert after.index(("replace", f"{tracker}.tmp", tracker)) < after.index(
        ("fsync", str(tmp_path)), 1
    )
