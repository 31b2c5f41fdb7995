"""MetricsLogger writes exactly the series it is given, read back with each backend's reader."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.training.loggers import (
    METRIC_NAMES,
    VS_SAMPLES_NAMES,
    MetricsLogger,
    check_logger_settings,
    wandb_mode,
)
from tests.unit_tests.ecosystem.readers import read_tensorboard_scalars, read_wandb_offline_scalars

TRAIN_STEPS = 120
VALIDATION_INTERVAL = 40
VALIDATION_NAMES = ("lm loss validation", "lm loss validation ppl")


def _expected_series() -> dict[str, list[tuple[int, float]]]:
    """Distinct values per metric and step, exactly representable in float32 so that TensorBoard
    (which stores float32) must return them bit for bit."""
    rng = np.random.default_rng(1234)
    series: dict[str, list[tuple[int, float]]] = {}
    for index, name in enumerate(METRIC_NAMES):
        steps = range(1, TRAIN_STEPS + 1)
        if name in VALIDATION_NAMES:
            steps = range(VALIDATION_INTERVAL, TRAIN_STEPS + 1, VALIDATION_INTERVAL)
        values = rng.uniform(0.0, 10.0 ** (index % 5), size=len(steps)).astype(np.float32)
        series[name] = [(step, float(value)) for step, value in zip(steps, values)]
    return series


def _log_series(logger: MetricsLogger, series: dict[str, list[tuple[int, float]]]) -> None:
    """Log train metrics each step, then validation metrics in a second call at the same step,
    the order the training loop uses."""
    by_step: dict[int, dict[str, dict[str, float]]] = {}
    for name, points in series.items():
        kind = "validation" if name in VALIDATION_NAMES else "train"
        for step, value in points:
            by_step.setdefault(step, {"train": {}, "validation": {}})[kind][name] = value
    for step in sorted(by_step):
        logger.log_scalars(step, by_step[step]["train"])
        if by_step[step]["validation"]:
            logger.log_scalars(step, by_step[step]["validation"])


@pytest.fixture
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="needs wandb (pip install wandb)")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_tensorboard_and_wandb_offline_read_back_every_point(tmp_path, offline_wandb) -> None:
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    expected = _expected_series()
    logger = MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project="megatron-fp8-test",
        wandb_exp_name="loggers-roundtrip",
        wandb_save_dir=str(tmp_path / "wandb"),
        run_config={"num_layers": 2, "lr": 1e-3},
        enabled=True,
    )
    with logger:
        _log_series(logger, expected)

    assert read_tensorboard_scalars(str(tmp_path / "tb")) == expected
    assert read_wandb_offline_scalars(str(tmp_path / "wandb")) == expected
    total_points = sum(len(points) for points in expected.values())
    assert total_points == 12 * 120 + 2 * 3
    # The log spans several 32 KiB blocks, so records split across blocks were reassembled.
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert os.path.getsize(run_file) > 2 * 32768


def test_disabled_logger_writes_nothing(tmp_path) -> None:
    logger = MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project="p",
        wandb_exp_name="e",
        wandb_save_dir=str(tmp_path / "wandb"),
        run_config={},
        enabled=False,
    )
    logger.log_scalars(1, {"lm loss": 1.0})
    logger.close()
    assert os.listdir(tmp_path) == []


def test_tensorboard_only_leaves_no_wandb_files(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    with MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        run_config={},
        enabled=True,
    ) as logger:
        logger.log_scalars(5, {"lm loss": 2.5, "learning-rate": 0.125})
        logger.log_scalars(6, {"lm loss": 2.25})
    assert read_tensorboard_scalars(str(tmp_path / "tb")) == {
        "lm loss": [(5, 2.5), (6, 2.25)],
        "learning-rate": [(5, 0.125)],
    }
    assert os.listdir(tmp_path) == ["tb"]


def _tensorboard_only_logger(tmp_path) -> MetricsLogger:
    return MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        run_config={},
        enabled=True,
    )


def test_unknown_metric_and_decreasing_step_are_rejected(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    with _tensorboard_only_logger(tmp_path) as logger:
        with pytest.raises(ValueError, match=r"unknown metric name\(s\) \['lm-loss'\]"):
            logger.log_scalars(1, {"lm-loss": 1.0})
        logger.log_scalars(10, {"lm loss": 1.0})
        with pytest.raises(ValueError, match="step 9 is before the last logged step 10"):
            logger.log_scalars(9, {"lm loss": 1.0})


def test_moe_series_are_known_metrics(tmp_path) -> None:
    """The MoE router losses and per-layer expert loads that pretrain logs for an MoE model
    (with --tensorboard-dir, Megatron-LM's MoE command lines crashed on them)."""
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    moe = {
        "load_balancing_loss": 1.0,
        "seq_load_balancing_loss": 1.0,
        "z_loss": 2.0,
        "dropped_token_fraction": 0.25,
        "moe/layer_1/expert_0_load": 0.5,
    }
    with _tensorboard_only_logger(tmp_path) as logger:
        logger.log_scalars(1, moe)
    scalars = read_tensorboard_scalars(str(tmp_path / "tb"))
    assert {name: points[0][1] for name, points in scalars.items()} == moe


def test_missing_packages_name_the_pip_install(tmp_path, monkeypatch) -> None:
    # A None entry in sys.modules makes `import x` raise ImportError, as if x were absent.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _tensorboard_only_logger(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(
            tensorboard_dir=None,
            wandb_project="p",
            wandb_exp_name="e",
            wandb_save_dir=str(tmp_path),
            run_config={},
            enabled=True,
        )


def test_wandb_needs_a_name_and_a_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="--wandb-exp-name"):
        MetricsLogger(
            tensorboard_dir=None,
            wandb_project="p",
            wandb_exp_name=None,
            wandb_save_dir=str(tmp_path),
            run_config={},
            enabled=True,
        )
    with pytest.raises(ValueError, match="--wandb-save-dir"):
        MetricsLogger(
            tensorboard_dir=None,
            wandb_project="p",
            wandb_exp_name="e",
            wandb_save_dir=None,
            run_config={},
            enabled=True,
        )


def test_settings_check_runs_without_creating_anything(tmp_path, monkeypatch) -> None:
    """check_logger_settings is what every rank calls at parse time: same errors, no files."""
    with pytest.raises(ValueError, match="--wandb-exp-name"):
        check_logger_settings(
            tensorboard_dir=None, wandb_project="p", wandb_exp_name="", wandb_save_dir="d"
        )
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        check_logger_settings(
            tensorboard_dir=None, wandb_project="p", wandb_exp_name="e", wandb_save_dir="d"
        )
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    check_logger_settings(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
    )
    assert os.listdir(tmp_path) == []


def test_wandb_mode_follows_the_api_key(monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert wandb_mode() == "online"


@pytest.mark.slow
def test_pretrain_gpt_logs_the_same_series_to_log_tensorboard_and_wandb(
    tmp_path, offline_wandb
) -> None:
    """End to end: the log lines, TensorBoard and W&B of one tiny training run agree point for
    point (TensorBoard stores float32; log lines print 7 significant digits)."""
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    import subprocess

    from tools.plot_losses import parse_log_lines

    repo_root = Path(__file__).resolve().parents[3]
    args = (
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 1 "
        "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 2 --train-iters 6 --log-interval 2 --lr 1e-3 --eval-interval 3 "
        "--eval-iters 1 --wandb-project megatron-fp8-test --wandb-exp-name e2e"
    ).split()
    args += ["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-save-dir", str(tmp_path / "wb")]
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tensorboard = read_tensorboard_scalars(str(tmp_path / "tb"))
    wandb_series = read_wandb_offline_scalars(str(tmp_path / "wb"))
    vs_samples = {f"{name} vs samples" for name in VS_SAMPLES_NAMES}
    assert sorted(wandb_series) == sorted(METRIC_NAMES)
    assert sorted(tensorboard) == sorted({*METRIC_NAMES, *vs_samples})
    for name, points in wandb_series.items():
        # Megatron-LM's split: per-iteration series every --tensorboard-log-interval (1),
        # interval statistics every --log-interval (2), validation every --eval-interval (3).
        if name in VALIDATION_NAMES:
            expected_steps = [3, 6]
        elif name in VS_SAMPLES_NAMES or name == "samples vs steps":
            expected_steps = [1, 2, 3, 4, 5, 6]
        else:
            expected_steps = [2, 4, 6]
        assert [step for step, _ in points] == expected_steps, name
        assert [step for step, _ in tensorboard[name]] == expected_steps, name
        for (_, tb_value), (_, wandb_value) in zip(tensorboard[name], points):
            assert tb_value == pytest.approx(wandb_value, rel=1e-6, abs=1e-30), name
    for name in VS_SAMPLES_NAMES:  # the same values at x = consumed samples (batch size 2)
        by_samples = tensorboard[f"{name} vs samples"]
        assert [x for x, _ in by_samples] == [2 * step for step, _ in tensorboard[name]], name
        assert [v for _, v in by_samples] == [v for _, v in tensorboard[name]], name
    assert [v for _, v in wandb_series["samples vs steps"]] == [2.0 * i for i in range(1, 7)]
    run = parse_log_lines(result.stdout.splitlines(), source="pretrain_gpt.py stdout")
    assert run.iterations == [2, 4, 6]
    per_iteration = [value for _, value in wandb_series["lm loss"]]
    interval_means = [(a + b) / 2 for a, b in zip(per_iteration[0::2], per_iteration[1::2])]
    assert interval_means == pytest.approx(run.series["lm loss"], rel=1e-6)
    log_validation = run.validation_series["lm loss validation"]
    wandb_validation = [value for _, value in wandb_series["lm loss validation"]]
    assert wandb_validation == pytest.approx(log_validation, rel=1e-6)
    assert [value for _, value in wandb_series["learning-rate"]][1::2] == pytest.approx(
        run.series["learning-rate"], rel=1e-6
    )


def test_samples_add_vs_samples_series_to_tensorboard_once_per_step(tmp_path) -> None:
    """Megatron-LM's "<name> vs samples" TensorBoard series (x = consumed samples) for the
    VS_SAMPLES_NAMES, and one "samples vs steps" point per step even when train and validation
    metrics are logged at the same step."""
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    logger = MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        run_config={},
        enabled=True,
    )
    with logger:
        logger.log_scalars(1, {"lm loss": 3.5, "iteration-time": 0.25}, samples=8)
        logger.log_scalars(2, {"lm loss": 3.25, "learning-rate": 0.5}, samples=16)
        logger.log_scalars(2, {"lm loss validation": 3.0}, samples=16)
    scalars = read_tensorboard_scalars(str(tmp_path / "tb"))
    assert scalars["lm loss"] == [(1, 3.5), (2, 3.25)]
    assert scalars["lm loss vs samples"] == [(8, 3.5), (16, 3.25)]
    assert scalars["learning-rate vs samples"] == [(16, 0.5)]
    assert scalars["lm loss validation vs samples"] == [(16, 3.0)]
    assert scalars["samples vs steps"] == [(1, 8.0), (2, 16.0)]
    assert "iteration-time vs samples" not in scalars
