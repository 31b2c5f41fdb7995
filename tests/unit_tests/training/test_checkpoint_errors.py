"""Bad checkpoints and --load paths fail before training with a CheckpointError that names the
file and the fix: malformed metadata and tensor files, a different optimizer, model shapes that
differ from the checkpoint's, and corrupt Megatron-FSDP (torch_dist) shards."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

import megatron.training.training as training
from megatron.training.checkpoint import CheckpointError, load_state_for_export
from tests.unit_tests.training.common import TINY_GPT, run_pretrain

FSDP = ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"]
ITER_DIR = "iter_0000002"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-iteration Adam checkpoint in --ckpt-format torch."""
    root = tmp_path_factory.mktemp("torch_ckpt")
    run_pretrain(TINY_GPT + ["--train-iters", "2", "--save", str(root)])
    return root


@pytest.fixture(scope="module")
def saved_fsdp(tmp_path_factory):
    """A 2-iteration Adam checkpoint of Megatron-FSDP in --ckpt-format torch_dist."""
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    run_pretrain(TINY_GPT + FSDP + ["--train-iters", "2", "--save", str(root)])
    return root


def _copy(root, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(root, target)
    return target


def _load_error(root, extra=()) -> str:
    """The CheckpointError message of resuming from root. pretrain frees the one-rank process
    group it made for Megatron-FSDP when it fails, so the next test starts without one."""
    with pytest.raises(CheckpointError) as info:
        run_pretrain(TINY_GPT + ["--train-iters", "4", "--load", str(root), *extra])
    assert not dist.is_initialized()
    return str(info.value)


# --- 5. malformed files of a torch-format checkpoint --------------------------------------


def _binary_tracker(root):
    (root / "latest_checkpointed_iteration.txt").write_bytes(b"\x80\xff\x00\x13")


def _binary_metadata(root):
    (root / ITER_DIR / "metadata.json").write_bytes(b"\x80\x04\x95\xff" * 8)


def _edit_metadata(root, edit):
    path = root / ITER_DIR / "metadata.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _without(key):
    return lambda root: _edit_metadata(
        root, lambda meta: {k: v for k, v in meta.items() if k != key}
    )


def _replace_tensor_file(relative, obj):
    return lambda root: torch.save(obj, root / ITER_DIR / relative)


MALFORMED = {
    "binary-tracker": (
        _binary_tracker,
        "latest_checkpointed_iteration.txt: binary data, not an iteration number",
    ),
    "binary-metadata": (_binary_metadata, "metadata.json: not valid JSON (UnicodeDecodeError"),
    "metadata-list": (
        lambda root: (root / ITER_DIR / "metadata.json").write_text("[]"),
        "metadata.json: holds a JSON list, not an object",
    ),
    "no-scheduler": (_without("scheduler"), "metadata.json: bad entries scheduler (missing)"),
    "iteration-not-int": (
        lambda root: _edit_metadata(root, lambda meta: {**meta, "iteration": "2"}),
        "metadata.json: bad entries iteration (not a JSON int)",
    ),
    "scheduler-empty": (
        lambda root: _edit_metadata(root, lambda meta: {**meta, "scheduler": {}}),
        "metadata.json: 'scheduler' is not a learning-rate schedule state (KeyError",
    ),
    "param-shapes-list": (
        lambda root: _edit_metadata(root, lambda meta: {**meta, "param_shapes": [1, 2]}),
        "metadata.json: 'param_shapes' is not {name: [sizes]}",
    ),
    "optimizer-structure": (
        _replace_tensor_file("optimizer.pt", {"step": torch.zeros(1)}),
        "optimizer.pt: not this run's optimizer state (KeyError: 'param_groups')",
    ),
    "rng-structure": (
        _replace_tensor_file("rng/rank_00000.pt", {"torch_cpu": torch.zeros(1)}),
        "rank_00000.pt: not an RNG state (KeyError: 'numpy')",
    ),
    "model-list": (
        _replace_tensor_file("model.pt", [torch.zeros(1)]),
        "model.pt: not a {param name: tensor} dict",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_names_file_and_problem(saved, tmp_path, case):
    corrupt, expected = MALFORMED[case]
    root = _copy(saved, tmp_path)
    corrupt(root)
    message = _load_error(root)
    assert expected in message
    assert str(root) in message  # the path, not only the file name


def test_unfinished_save_named_when_tracker_points_at_it(saved, tmp_path):
    root = _copy(saved, tmp_path)
    os.rename(root / ITER_DIR, root / f"{ITER_DIR}.tmp")
    message = _load_error(root)
    assert f"names iteration 2, but {root / ITER_DIR} does not exist" in message
    assert "(its .tmp copy is an unfinished save)" in message


# --- 6. --load paths -----------------------------------------------------------------------


def _refuse_model_setup(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before --load was checked")

    monkeypatch.setattr(training, "setup_model_and_optimizer", refuse)


def test_load_path_that_is_a_file_fails_before_the_model_is_built(tmp_path, monkeypatch):
    load_file = tmp_path / "checkpoint.pt"
    load_file.write_bytes(b"not a directory")
    _refuse_model_setup(monkeypatch)
    message = _load_error(load_file)
    assert message.startswith(f"--load {load_file} is a file, not a directory;")
    assert "latest_checkpointed_iteration.txt" in message


def test_load_of_an_iteration_directory_names_its_parent(saved, monkeypatch):
    _refuse_model_setup(monkeypatch)
    message = _load_error(saved / ITER_DIR)
    assert f"--load {saved / ITER_DIR} is one iteration's directory; pass its parent" in message


@pytest.mark.parametrize("existing", [False, True], ids=["missing-dir", "empty-dir"])
def test_missing_or_empty_load_dir_trains_from_scratch(tmp_path, capsys, existing):
    """`--save X --load X` on a first start: Megatron's behaviour, with a log line saying so."""
    load_dir = tmp_path / "ckpt"
    if existing:
        load_dir.mkdir()
    result = run_pretrain(TINY_GPT + ["--train-iters", "2", "--load", str(load_dir)])
    assert sorted(result.losses) == [1, 2]
    assert f" > no checkpoint under --load {load_dir}; training from scratch" in (
        capsys.readouterr().out
    )


# --- 3. a different optimizer --------------------------------------------------------------


@pytest.mark.parametrize("fsdp", [False, True], ids=["torch", "torch_dist"])
def test_other_optimizer_needs_no_load_optim(saved, saved_fsdp, fsdp):
    root, extra = (saved_fsdp, FSDP) if fsdp else (saved, [])
    message = _load_error(root, [*extra, "--optimizer", "sgd"])
    assert "saved with --optimizer adam, but this run has --optimizer sgd" in message
    assert "pass --optimizer adam, or --no-load-optim (or --finetune)" in message
    try:
        argv = TINY_GPT + extra + ["--train-iters", "3", "--load", str(root), "--optimizer", "sgd"]
        fresh_optimizer = run_pretrain(argv + ["--no-load-optim"])
        finetune = run_pretrain(argv + ["--finetune"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(fresh_optimizer.losses) == [3]  # weights and iteration restored, SGD fresh
    assert sorted(finetune.losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(list(finetune.losses.values()))))


@pytest.mark.parametrize("fsdp", [False, True], ids=["torch", "torch_dist"])
def test_other_amax_history_length_is_named_before_training(tmp_path, fsdp):
    """Delayed scaling saves each FP8 tensor's amax history: another length cannot load it
    (torch_dist reported a corrupt shard). --finetune loads only the weights, in both formats."""
    extra = [*(FSDP if fsdp else []), "--fp8-recipe", "delayed", "--lr-decay-iters", "4"]
    run_pretrain(
        TINY_GPT
        + extra
        + ["--train-iters", "2", "--fp8-amax-history-len", "4", "--save", str(tmp_path)]
    )
    try:
        message = _load_error(tmp_path, [*extra, "--fp8-amax-history-len", "8"])
        assert "saved with --fp8-amax-history-len 4, but this run has 8" in message
        assert "Pass --fp8-amax-history-len 4, or --finetune" in message
        resumed = run_pretrain(
            TINY_GPT
            + extra
            + ["--train-iters", "3", "--load", str(tmp_path), "--fp8-amax-history-len", "4"]
        )
        finetune = run_pretrain(
            TINY_GPT
            + extra
            + [
                "--train-iters",
                "3",
                "--load",
                str(tmp_path),
                "--fp8-amax-history-len",
                "8",
                "--finetune",
            ]
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(resumed.losses) == [3]
    assert sorted(finetune.losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(list(finetune.losses.values()))))


@pytest.mark.parametrize("fsdp", [False, True], ids=["torch", "torch_dist"])
def test_no_save_optim_and_rng_write_neither_and_resume_needs_the_no_load_flags(tmp_path, fsdp):
    from torch.distributed.checkpoint import FileSystemReader

    extra = [*(FSDP if fsdp else []), "--lr-decay-iters", "4"]
    run_pretrain(
        TINY_GPT
        + extra
        + ["--train-iters", "2", "--save", str(tmp_path), "--no-save-optim", "--no-save-rng"]
    )
    saved = tmp_path / ITER_DIR
    assert not (saved / "rng").exists() and not (saved / "optimizer.pt").exists()
    if fsdp:
        keys = FileSystemReader(str(saved / "sharded")).read_metadata().state_dict_metadata
        assert keys and not [key for key in keys if key.startswith("optimizer")]
    try:
        message = _load_error(tmp_path, extra)
        assert (
            "saved with --no-save-optim, so it holds no optimizer state; pass --no-load-optim"
            in message
        )
        message = _load_error(tmp_path, [*extra, "--no-load-optim"])
        assert "saved with --no-save-rng, so it holds no RNG states; pass --no-load-rng" in message
        resumed = run_pretrain(
            TINY_GPT
            + extra
            + ["--train-iters", "3", "--load", str(tmp_path), "--no-load-optim", "--no-load-rng"]
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(resumed.losses) == [3]
    assert all(torch.isfinite(torch.tensor(list(resumed.losses.values()))))


def test_train_samples_run_resumes_only_at_its_global_batch_size(tmp_path):
    """A --train-samples run counts its iterations and schedule in global batches: another
    batch size would stop at the wrong sample count, so the resume is refused."""
    flags = ["--train-samples", "40"]  # 5 iterations of 8
    run_pretrain(TINY_GPT + flags + ["--exit-interval", "2", "--save", str(tmp_path)])
    with pytest.raises(CheckpointError) as info:
        run_pretrain(
            TINY_GPT
            + ["--train-samples", "80", "--global-batch-size", "16", "--load", str(tmp_path)]
        )
    message = str(info.value)
    assert "saved with --global-batch-size 8, but this run has 16" in message
    assert "Pass --global-batch-size 8" in message
    resumed = run_pretrain(TINY_GPT + flags + ["--load", str(tmp_path)])
    assert sorted(resumed.losses) == [3, 4, 5]


# --- 4. Megatron-FSDP: shapes that differ, corrupt shards -----------------------------------


def test_fsdp_vocab_size_mismatch_names_the_flag(saved_fsdp):
    message = _load_error(saved_fsdp, [*FSDP, "--vocab-size", "1024"])
    assert "saved with --vocab-size 512, but this run has 1024" in message
    assert "Pass --vocab-size 512, or --finetune" in message
    # --finetune skips the flag comparison; the parameter shapes still decide, with the fix.
    message = _load_error(saved_fsdp, [*FSDP, "--vocab-size", "1024", "--finetune"])
    assert (
        f"{saved_fsdp / ITER_DIR / 'metadata.json'}: embedding.word_embeddings.weight has shape "
        "(512, 64) in the checkpoint, the model expects (1024, 64)" in message
    )
    assert "pass --vocab-size 512 and --make-vocab-size-divisible-by 128, as saved" in message


def test_another_vocabulary_with_the_same_padded_rows_is_refused(saved):
    """--vocab-size 400 pads to the saved 512 rows: the shapes fit, the ids do not (Megatron-LM
    compares the tokenizer); --finetune loads the weights for a new vocabulary."""
    message = _load_error(saved, ["--vocab-size", "400"])
    assert "saved with --vocab-size 512, but this run has 400: the token ids" in message
    assert "Pass --vocab-size 512, or --finetune to load only the weights" in message
    byte_tokens = [a for a in TINY_GPT if a not in ("--vocab-size", "512")]
    byte_tokens[byte_tokens.index("NullTokenizer")] = "ByteTokenizer"
    with pytest.raises(CheckpointError) as info:
        run_pretrain(byte_tokens + ["--train-iters", "4", "--load", str(saved)])
    message = str(info.value)
    assert "saved with --tokenizer-type NullTokenizer, but this run has ByteTokenizer" in message
    finetune = run_pretrain(
        TINY_GPT + ["--train-iters", "2", "--load", str(saved), "--vocab-size", "400", "--finetune"]
    )
    assert sorted(finetune.losses) == [1, 2]


def test_another_fp8_format_is_refused_for_delayed_state(tmp_path):
    """Delayed scaling's saved scales are for the saved format's dtypes: under another format
    the first backward would quantize E4M3 gradients with an E5M2 scale (it saturated)."""
    extra = ["--fp8-recipe", "delayed", "--fp8-amax-history-len", "4", "--lr-decay-iters", "4"]
    run_pretrain(
        TINY_GPT + extra + ["--train-iters", "2", "--fp8-format", "hybrid", "--save", str(tmp_path)]
    )
    message = _load_error(tmp_path, [*extra, "--fp8-format", "e4m3"])
    assert "saved with --fp8-format hybrid, but this run has e4m3" in message
    assert "Pass --fp8-format hybrid, or --finetune" in message
    resumed = run_pretrain(
        TINY_GPT + extra + ["--train-iters", "3", "--load", str(tmp_path), "--fp8-format", "hybrid"]
    )
    assert sorted(resumed.losses) == [3]


def test_fsdp_learned_position_mismatch_names_the_flag(saved_fsdp):
    message = _load_error(saved_fsdp, [*FSDP, "--seq-length", "64"])
    assert "embedding.position_embeddings.weight has shape (32, 64) in the checkpoint" in message
    assert "pass --max-position-embeddings 32 (it defaults to --seq-length)" in message


def test_fsdp_checkpoint_without_recorded_shapes_still_fails_cleanly(saved_fsdp, tmp_path):
    """Checkpoints saved before metadata.json recorded shapes: DCP's size check, wrapped."""
    root = _copy(saved_fsdp, tmp_path)
    _without("param_shapes")(root)
    # --finetune: past the saved-flag comparison (another --vocab-size), to the shapes' check.
    message = _load_error(root, [*FSDP, "--vocab-size", "1024", "--finetune"])
    assert message.startswith(f"{root / ITER_DIR / 'sharded'}: cannot be loaded (ValueError: ")
    assert "Size mismatch" in message and "model.params.embedding.word_embeddings.weight" in message


def _shard(root):
    (shard,) = (root / ITER_DIR / "sharded").glob("*.distcp")
    return shard


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _zero(path):
    path.write_bytes(bytes(path.stat().st_size))


def _shard_named(reason):
    """The message names the shard file itself, from the directory down."""
    return lambda root: f"{_shard(root)}: cannot be read ({reason}"


CORRUPT_SHARDS = {
    # The cause depends on which tensor is read first (a zip error, an EOFError).
    "truncated-distcp": (lambda root: _truncate(_shard(root)), _shard_named("")),
    # torch.load's own message for a zeroed file advises weights_only=False: never relayed.
    "zeroed-distcp": (
        lambda root: _zero(_shard(root)),
        _shard_named("UnpicklingError: not tensor data)"),
    ),
    "missing-distcp": (
        lambda root: _shard(root).unlink(),
        _shard_named("FileNotFoundError: No such file or directory)"),
    ),
    "truncated-metadata": (
        lambda root: _truncate(root / ITER_DIR / "sharded" / ".metadata"),
        lambda root: "sharded/.metadata: cannot be read (",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_SHARDS))
def test_fsdp_corrupt_shard_is_a_checkpoint_error(saved_fsdp, tmp_path, case):
    corrupt, expected_of = CORRUPT_SHARDS[case]
    root = _copy(saved_fsdp, tmp_path)
    expected = expected_of(root)  # before the damage: a missing shard has no path afterwards
    corrupt(root)
    message = _load_error(root, FSDP)
    assert message.startswith(str(root / ITER_DIR / "sharded")) and expected in message, message
    assert "Load another iteration." in message
    assert "weights_only" not in message
    with pytest.raises(CheckpointError) as export_error:  # the HF export reads the same files
        load_state_for_export(str(root))
    assert expected in str(export_error.value)
    assert "weights_only" not in str(export_error.value)


# --- a learning-rate schedule that differs from the checkpoint's ----------------------------


def _logged_lrs(out: str) -> dict[int, float]:
    found = re.findall(r"iteration +(\d+)/ +\d+ \|.* learning rate: ([0-9.E+-]+) \|", out)
    return {int(it): float(lr) for it, lr in found}


def test_longer_train_iters_needs_a_schedule_choice(saved, capsys):
    """saved: 2 iterations, linear decay to lr 0 at --lr-decay-iters = --train-iters = 2.
    A run to 4 iterations moves the decay end: refused unless a schedule is chosen."""
    message = _load_error(saved)  # --train-iters 4
    assert "--lr-decay-iters (default --train-iters): saved 2, now 4" in message
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    argv = TINY_GPT + ["--train-iters", "4", "--load", str(saved)]
    capsys.readouterr()
    override = run_pretrain(argv + ["--override-opt_param-scheduler"])
    override_lrs = _logged_lrs(capsys.readouterr().out)
    kept = run_pretrain(argv + ["--use-checkpoint-opt_param-scheduler"])
    kept_lrs = _logged_lrs(capsys.readouterr().out)
    assert sorted(override.losses) == sorted(kept.losses) == [3, 4]
    # This run's schedule: linear from 1e-3 at 0 to 0 at 4 -> update 3 at 2.5e-4, 4 at 0.
    assert override_lrs == {3: pytest.approx(2.5e-4), 4: 0.0}
    # The checkpoint's: past its decay end (2), so min-lr 0 for both updates.
    assert kept_lrs == {3: 0.0, 4: 0.0}
    # Iteration 3's loss is computed before its update, on the saved weights: the same in
    # both runs; the updates at different lrs then make iteration 4 differ.
    assert kept.losses[3] == override.losses[3]
    assert kept.losses[4] != override.losses[4]


# --- a tracker lost next to complete iterations ---------------------------------------------


def test_missing_tracker_next_to_iterations_is_refused(tmp_path, monkeypatch):
    """Not "training from scratch": the directories are named, and the fix (--ckpt-step)."""
    root = tmp_path / "ckpt"
    run_pretrain(TINY_GPT + ["--train-iters", "3", "--save", str(root), "--save-interval", "1"])
    (root / "latest_checkpointed_iteration.txt").unlink()
    (root / "iter_0000004.tmp").mkdir()  # an unfinished save is not offered
    _refuse_model_setup(monkeypatch)
    message = _load_error(root)
    assert message == (
        f"--load {root} holds iter_0000001, iter_0000002, iter_0000003 but no "
        "latest_checkpointed_iteration.txt, so which iteration to resume is unknown; pass "
        "--ckpt-step N (e.g. --ckpt-step 3, the newest) or write N into "
        f"{root / 'latest_checkpointed_iteration.txt'}."
    )


def test_ckpt_step_resumes_the_named_iteration(tmp_path, capsys):
    root = tmp_path / "ckpt"
    save = ["--save", str(root), "--save-interval", "1"]
    full = run_pretrain(TINY_GPT + ["--train-iters", "4", *save])
    (root / "latest_checkpointed_iteration.txt").unlink()
    resumed = run_pretrain(
        TINY_GPT + ["--train-iters", "4", "--load", str(root), "--ckpt-step", "2"]
    )
    assert f" > loaded checkpoint {root / 'iter_0000002'} (iteration 2)" in capsys.readouterr().out
    assert sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[i] for i in (3, 4)] == [full.losses[i] for i in (3, 4)]


def test_bad_load_path_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    load_file = tmp_path / "not_a_dir"
    load_file.write_text("x")
    argv = [sys.executable, "pretrain_gpt.py", *TINY_GPT, "--train-iters", "2"]
    done = subprocess.run(
        [*argv, "--load", str(load_file)], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: rank 0: --load {load_file} is a file, not a directory; point --load at the "
        "directory that --save wrote (it holds latest_checkpointed_iteration.txt and "
        "iter_XXXXXXX/)."
    ]
    debug = subprocess.run(
        [*argv, "--load", str(load_file)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MEGATRON_TRACEBACK": "1"},
    )
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


# --- torch_dist .metadata is never run ------------------------------------------------------


class _MetadataPayload:
    """Unpickling this makes a directory: the proof that a file ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_metadata_is_refused_and_not_run(saved_fsdp, tmp_path):
    import pickle

    root = _copy(saved_fsdp, tmp_path)
    marker = str(tmp_path / "pwned_by_metadata")
    metadata_path = root / ITER_DIR / "sharded" / ".metadata"
    with open(metadata_path, "wb") as handle:
        pickle.dump({"metadata": _MetadataPayload(marker)}, handle)
    message = _load_error(root, FSDP)
    assert message.startswith(f"{metadata_path}: refused: it refers to posix.mkdir, which a ")
    assert not os.path.exists(marker)


def test_metadata_with_pickled_entries_is_refused(saved_fsdp, tmp_path):
    """DCP would torch.load a bytes entry with weights_only=False: such metadata is refused."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = _copy(saved_fsdp, tmp_path)
    metadata_path = root / ITER_DIR / "sharded" / ".metadata"
    with open(metadata_path, "rb") as handle:
        metadata = pickle.load(handle)  # our own file, written by the fixture
    metadata.state_dict_metadata["model.params.decoder.layers.0.mlp.linear_fc1.weight"] = (
        BytesStorageMetadata()
    )
    with open(metadata_path, "wb") as handle:
        pickle.dump(metadata, handle)
    message = _load_error(root, FSDP)
    assert "refused: it declares pickled-object entries (model.params.decoder.layers.0" in message
