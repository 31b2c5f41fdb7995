"""benchmarks/fidelity_suite.py end to end on CPU: the smoke size, bf16 and tensorwise at two
seeds, 3 iterations each; the summary's ratios are recomputed from the runs' losses."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_suite(tmp_path: Path, size: str, *extra: str, returncode: int = 0) -> tuple[Path, str]:
    """The suite at `size`, bf16 and tensorwise at seeds 11 and 12 on 0.3 MB of the stdlib
    corpus, 4 runs at once; its --out directory and stdout (the suite must exit `returncode`)."""
    out = tmp_path / "suite"
    command = [sys.executable, "benchmarks/fidelity_suite.py", "--out", str(out)]
    command += ["--size", size, "--recipes", "tensorwise", "--seeds", "11", "12"]
    command += ["--parallel", "4", "--stdlib-mb", "0.3", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == returncode, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout + result.stderr


@pytest.mark.timeout(240)
def test_smoke_suite_end_to_end(tmp_path):
    """In two calls, as a device job longer than one call runs: the first starts 2 of the 4
    runs (seed 11's, plan order) and summarizes 1 pair; the second runs only the 2 left."""
    out, stdout = _run_suite(tmp_path, "smoke", "--max-runs", "2")
    assert "2 of 4 runs start now" in stdout and "2 runs left for a later call" in stdout
    first = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["recipe"], r["seed"], r["valid_loss"] is not None) for r in first] == [
        ("bf16", 11, True), ("tensorwise", 11, True), ("bf16", 12, False), ("tensorwise", 12, False)
    ]  # fmt: skip
    (partial,) = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert partial["seeds"] == [11] and partial["verdict"] == "undetermined (1 of 2 seeds)"
    done_logs = {r["log"]: Path(r["log"]).read_text() for r in first if r["valid_loss"]}
    out, stdout = _run_suite(tmp_path, "smoke", "--skip-done")
    assert "2 of 4 runs start now" in stdout and "left for a later call" not in stdout
    assert all(Path(log).read_text() == text for log, text in done_logs.items())
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["recipe"], r["seed"]) for r in runs) == [
        ("bf16", 11), ("bf16", 12), ("tensorwise", 11), ("tensorwise", 12)
    ]  # fmt: skip
    # Seed 11's runs were done before this call (no exit code now); seed 12's ran in it.
    assert [r["returncode"] for r in runs] == [None, None, 0, 0]
    assert all(r["valid_loss"] > 0 for r in runs)
    # FP8 runs log their statistics every max(1, 3 // 2) = 1 step here (halfway and at the
    # end of a long run): the last ones, one line per role, are kept per run; bf16 has none.
    for r in runs:
        stats = r["fp8_stats"]
        if r["recipe"] == "bf16":
            assert stats == [] and "fp8 stats" not in Path(r["log"]).read_text()
        else:
            assert stats and all(line.startswith("> fp8 stats iteration 3 |") for line in stats)
            assert {line.split("|")[1].split("(")[0].strip() for line in stats} >= {"input"}
    loss = {(r["recipe"], r["seed"]): r["valid_loss"] for r in runs}
    (summary,) = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    expected = [loss[("tensorwise", s)] / loss[("bf16", s)] for s in (11, 12)]
    assert summary["seeds"] == [11, 12]
    assert summary["ratios"] == pytest.approx(expected, rel=1e-12)
    assert summary["mean"] == pytest.approx(sum(expected) / 2, rel=1e-12)
    assert summary["low"] <= summary["mean"] <= summary["high"]
    # 3 steps x 2 x 64 tokens over the corpus's 80% training share (split 80,20,0).
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = out / "data" / "stdlib" / "stdlib_text_document"
    epochs = 3 * 2 * 64 / (IndexedDataset(str(prefix)).num_tokens * 0.8)
    assert summary["epochs"] == pytest.approx(epochs, rel=1e-12) and 0 < epochs < 0.01
    assert (
        f"| stdlib_smoke_3 | cpu | {epochs:.2f} | tensorwise | 2 |"
        in (out / "summary.md").read_text()
    )
    assert {r["card"] for r in runs} == {"cpu"}  # no nvidia-smi on CI
    # The same seed gives the same data and init: bf16 and tensorwise start within 1%.
    assert 0.99 < summary["mean"] < 1.01
    pytest.importorskip("matplotlib")
    assert (out / "loss_curves.png").stat().st_size > 1000


@pytest.mark.timeout(240)
def test_moe_smoke_size_trains_routed_experts(tmp_path):
    """The suite's MoE size (model M-small's flags at smoke scale, issue 38 acceptance 6):
    bf16 and tensorwise at two seeds train routed experts with the aux loss (logged), and
    the same seed starts bf16 and tensorwise within 1%. With --repeat-control, bf16 runs twice
    at each seed; on CPU the two runs are bitwise the same, so the control's ratios are 1."""
    out, _ = _run_suite(tmp_path, "moe-smoke", "--repeat-control")
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["recipe"] for r in runs] == ["bf16", "bf16_repeat", "tensorwise"] * 2
    assert all(r["returncode"] == 0 and r["valid_loss"] > 0 for r in runs)
    for run in runs:
        log = Path(run["log"])
        assert "--num-experts 4" in Path(f"{log}.cmd").read_text()
        assert log.read_text().count("load_balancing_loss: ") == 3
    control, summary = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    assert control["recipe"] == "bf16_repeat" and control["ratios"] == [1.0, 1.0]
    assert control["sd"] == 0.0 and control["seeds_needed"] == 2
    assert control["verdict"] == "the floor: bf16 against itself"
    assert summary["recipe"] == "tensorwise" and 0.99 < summary["mean"] < 1.01


def test_runs_pair_only_on_the_same_card():
    """A chunked suite can run seed 1's bf16 on one card and its tensorwise on another: that
    pair is not formed; each card's own pairs are summarized apart."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_results import summarize

    def row(recipe, seed, card, loss):
        return dict(job="j", recipe=recipe, seed=seed, card=card, valid_loss=loss)

    rows = [
        row("bf16", 1, "H100", 2.0), row("tensorwise", 1, "H200", 2.2),
        row("bf16", 2, "H200", 4.0), row("tensorwise", 2, "H200", 4.04),
        row("bf16", 3, "H200", 5.0), row("tensorwise", 3, "H200", 4.95),
    ]  # fmt: skip
    by_card = {s["card"]: s for s in summarize(rows, ["tensorwise"], 0.01)}
    assert by_card["H200"]["seeds"] == [2, 3]
    assert by_card["H200"]["ratios"] == pytest.approx([1.01, 0.99], rel=1e-12)
    assert by_card["H100"]["seeds"] == [] and by_card["H100"]["bf16_mean"] is None  # no pair


@pytest.mark.timeout(420)
def test_runs_longer_than_a_call_stop_and_resume(tmp_path):
    """--stop-after-mins with --checkpoint-dir: the first call's runs save and stop after one
    iteration (left, not failed); the next call (--skip-done) resumes each from its checkpoint,
    appends to its log and removes the checkpoint once the validation loss is in. The resumed
    runs' losses equal one uninterrupted suite's."""
    checkpoints = tmp_path / "checkpoints"
    resume = ["--checkpoint-dir", str(checkpoints)]
    out, stdout = _run_suite(tmp_path, "smoke", *resume, "--stop-after-mins", "1e-6")
    assert "4 runs left for a later call" in stdout
    first = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["returncode"], r["valid_loss"], r["left"]) for r in first] == [(0, None, True)] * 4
    for run in first:
        tracker = checkpoints / run["job"] / f"{run['recipe']}@{run['seed']}"
        assert (tracker / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # A call with another model than the checkpoints' is refused before any run starts.
    out, stdout = _run_suite(
        tmp_path, "smoke", *resume, "--skip-done", "--stop-after-mins", "1e-6",
        "--extra", "--ffn-hidden-size", "96", returncode=2,
    )  # fmt: skip
    assert "runs start now" not in stdout and "was made by another command" in stdout
    assert "'--ffn-hidden-size 96' in this one" in stdout
    out, stdout = _run_suite(tmp_path, "smoke", *resume, "--skip-done", "--stop-after-mins", "9")
    assert "4 of 4 runs start now" in stdout and "left for a later call" not in stdout
    resumed = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert not any(checkpoints.glob("*/*@*"))  # removed once each run had its loss
    for run in resumed:
        text = Path(run["log"]).read_text()
        assert "(iteration 1)" in text and " > loaded checkpoint " in text
        assert text.count("iteration        1/") == 1 and "iteration        3/" in text
    whole, _ = _run_suite(tmp_path / "whole", "smoke")
    uninterrupted = [json.loads(line) for line in (whole / "runs.jsonl").read_text().splitlines()]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert (a["recipe"], a["seed"]) == (b["recipe"], b["seed"])
        assert a["valid_loss"] == pytest.approx(b["valid_loss"], rel=1e-6, abs=0)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6, abs=0)


def test_a_checkpoint_keeps_its_newest_save_and_one_at_its_end_is_removed(tmp_path):
    """Before a start: a resumable checkpoint keeps only the save its tracker names (older
    saves and unfinished *.tmp folders go); one already at the run's end (its log lost the
    validation loss, or a stale folder) is removed, so the run starts afresh, not 'left'."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_suite import _prepare_checkpoint, _resumable

    def checkpoint(name: str, tracker: int, saves: list[str]) -> dict:
        folder = tmp_path / name
        for save in saves:
            (folder / save).mkdir(parents=True)
        (folder / "latest_checkpointed_iteration.txt").write_text(f"{tracker}\n")
        return dict(checkpoint=str(folder), iters=3)

    run = checkpoint("mid", 2, ["iter_0000001", "iter_0000002", "iter_0000003.tmp"])
    assert _resumable(run) and _prepare_checkpoint(run)
    assert sorted(p.name for p in Path(run["checkpoint"]).iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip
    done = checkpoint("end", 3, ["iter_0000003"])
    assert not _resumable(done) and not _prepare_checkpoint(done)
    assert not Path(done["checkpoint"]).exists()
    assert not _prepare_checkpoint(dict(checkpoint=None, iters=3))


def test_fp8_statistics_halfway_and_at_the_last_step(tmp_path):
    """FP8 runs log statistics where step % interval == 0: halfway and at the last step for an
    even step count, at the last step only for an odd one. A resumed run's log can hold a step's
    lines twice: one line per role is kept, of the last step logged."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_results import last_fp8_stats
    from benchmarks.fidelity_suite import recipe_flags

    def interval(iters):
        flags = recipe_flags("tensorwise", iters)
        return int(flags[flags.index("--log-fp8-stats-interval") + 1])

    assert [interval(n) for n in (3000, 1000, 1001, 3, 2, 1)] == [1500, 500, 1001, 3, 1, 1]
    assert "--log-fp8-stats" not in recipe_flags("bf16", 1000)
    log = tmp_path / "run.log"
    line = " > fp8 stats iteration {} | {} (8 Linears) | max amax: {} (fc1) | saturated: 0 | u: 0"
    lines = [line.format(500, "input", 1), line.format(500, "grad", 2), "other"]
    lines += [line.format(1000, "input", 3), line.format(1000, "grad", 4)]
    lines += [line.format(1000, "input", 5), line.format(1000, "grad", 6)]  # resumed, again
    log.write_text("\n".join(lines) + "\n")
    assert last_fp8_stats(str(log)) == [
        line.format(1000, r, v).strip() for r, v in [("input", 5), ("grad", 6)]
    ]
    log.write_text(line.format(500, "input", 1) + "\n" + line.format(1000, "grad", 2) + "\n")
    assert last_fp8_stats(str(log)) == [line.format(1000, "grad", 2).strip()]
    log.write_text("no statistics\n")
    assert last_fp8_stats(str(log)) == []


def test_micro_batch_size_sets_the_runs_job_and_epochs(tmp_path, capsys):
    """--micro-batch-size replaces the size's micro-batch (= global batch) in every run, names
    its own job (results of two batch sizes never pair) and scales the epochs the plan prints;
    a plan past one epoch says so."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_suite import OVER_ONE_EPOCH, parse_args, plan_runs

    def plan(*extra: str) -> tuple[list[dict], str]:
        argv = ["--out", str(tmp_path / "s"), "--size", "smoke", "--recipes", "tensorwise"]
        argv += ["--seeds", "1", "2", "--stdlib-mb", "0.3", "--iters", "400", *extra]
        runs = plan_runs(parse_args(argv))
        return runs, runs[0]["job"]

    def epochs(printed: str) -> float:
        return float(printed.split(" tokens, ")[1].split(" epochs")[0])

    default, job = plan()
    once = capsys.readouterr().out
    halved, halved_job = plan("--micro-batch-size", "1")
    half = capsys.readouterr().out
    assert epochs(half) == pytest.approx(epochs(once) / 2, abs=0.01)
    assert "400 steps of 128 tokens" in once and "400 steps of 64 tokens" in half
    assert epochs(once) < 1 and OVER_ONE_EPOCH not in once
    plan("--iters", "8000")  # 8,000 x 128 tokens: past the 0.3 MB corpus's training split
    past = capsys.readouterr().out
    assert epochs(past) > 1 and OVER_ONE_EPOCH in past
    assert (job, halved_job) == ("stdlib_smoke_400", "stdlib_smoke_400_mbs1")
    for runs, mbs in ((default, "2"), (halved, "1")):
        command = runs[0]["command"]
        assert command[command.index("--micro-batch-size") + 1] == mbs
        assert command[command.index("--global-batch-size") + 1] == mbs
    with pytest.raises(SystemExit):
        parse_args(["--micro-batch-size", "0", "--seeds", "1", "2"])


def _validation_log(path: Path, iterations: list[int], command: str | None = None) -> str:
    lines = [f" validation loss at iteration {it} | lm loss value: {3 + it / 1000:.6E} |"
             for it in iterations]  # fmt: skip
    train = " [2026-12-07 17:19:03] iteration        1/    1000 | lm loss: 5.000000E+00 |"
    path.write_text("\n".join([train, *lines]) + "\n")
    if command is not None:
        Path(str(path) + ".cmd").write_text(command + "\n")
    return str(path)


def test_a_run_counts_only_its_validation_at_its_last_iteration(tmp_path):
    """A run stopped short whose log holds an earlier evaluation (an --extra --eval-interval)
    is neither done nor paired at that iteration."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_results import done, final_validation, read_results

    log = _validation_log(tmp_path / "r.log", [200, 400])
    run = dict(job="j", recipe="bf16", seed=1, iters=1000, log=log, returncode=0)
    assert final_validation(log, 1000) is None and not done(run)
    (row,) = read_results([run])
    assert row["valid_loss"] is None and row["state"] == "failed"  # ran now, ended short
    (row,) = read_results([dict(run, returncode=0, left=True)])
    assert row["state"] == "pending"  # stopped to be resumed by a later call
    _validation_log(tmp_path / "r.log", [200, 400, 1000])
    assert final_validation(log, 1000) == 4.0 and done(run)


def test_a_failed_seed_voids_the_verdict_and_bf16_mean_is_over_the_pairs():
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_results import summarize

    def row(recipe, seed, loss, state=None):
        state = state or ("done" if loss else "pending")
        return dict(job="j", card="H100", recipe=recipe, seed=seed, valid_loss=loss, state=state)

    rows = [row("bf16", s, 2.0 + s) for s in (1, 2, 3)]
    rows += [row("tensorwise", 1, 3.0), row("tensorwise", 2, 4.0)]
    rows += [row("tensorwise", 3, None, "failed")]  # diverged: no loss
    (summary,) = summarize(rows, ["tensorwise"], 0.01)
    assert summary["seeds"] == [1, 2] and summary["failed_seeds"] == [3]
    assert summary["verdict"] == "failed at seed(s) 3: no validation loss at the end"
    assert summary["bf16_mean"] == 3.5  # seeds 1 and 2 (3.0, 4.0), not seed 3's 5.0
    rows[-1] = row("tensorwise", 3, None)  # not run yet: the verdict says what it covers
    (summary,) = summarize(rows, ["tensorwise"], 0.01)
    assert summary["verdict"] == "within 1% (2 of 3 seeds)" and summary["failed_seeds"] == []


def test_kept_logs_of_another_command_are_refused(tmp_path, capsys):
    """A log made with other flags is not skipped as this run's result (nor its checkpoint
    resumed); the flags that change between calls (--exit-duration-in-mins) do not count."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_results import card_label, command_change
    from benchmarks.fidelity_suite import parse_args, refuse_other_commands

    command = ["python3", "pretrain_gpt.py", "--seed", "1", "--exit-duration-in-mins", "8.4"]
    log = _validation_log(
        tmp_path / "r.log", [3], "pretrain_gpt.py --seed 1 --exit-duration-in-mins 5"
    )
    run = dict(log=log, iters=3, command=command, checkpoint=None)
    assert command_change(run) is None
    run["command"] = ["python3", "pretrain_gpt.py", "--seed", "2"]
    assert command_change(run) == "'--seed 1' in the log's command, '--seed 2' in this one"
    args = parse_args(["--out", str(tmp_path), "--skip-done", "--seeds", "1", "2"])
    with pytest.raises(SystemExit) as exit_info:
        refuse_other_commands([run], args)
    assert exit_info.value.code == 2 and "was made by another command" in capsys.readouterr().err
    args = parse_args(["--out", str(tmp_path), "--seeds", "1", "2"])  # reruns it: not kept
    refuse_other_commands([run], args)
    # Where the checkpoint is (--checkpoint-dir spelled otherwise, or a --no-run summary
    # without it) is not the run's configuration; a path with a space reads back as written.
    spaced = ["python3", "pretrain_gpt.py", "--data-path", "my data/x", "--seed", "1"]
    Path(log + ".cmd").write_text(
        shlex.join([*spaced[1:], "--save", "/abs/ck", "--load", "/abs/ck"]) + "\n"
    )
    assert command_change(dict(run, command=[*spaced, "--save", "ck", "--load", "ck"])) is None
    assert command_change(dict(run, command=spaced)) is None
    assert card_label(None, "H100") == "H100" and card_label("H100", "H100") == "H100"
    assert card_label("H100 + H200", "H200") == "H100 + H200"
    assert card_label("H100 + H200", "H100") == "H100 + H200 + H100"
