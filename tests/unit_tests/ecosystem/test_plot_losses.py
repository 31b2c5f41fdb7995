"""tools/plot_losses.py: the training-log parser and the plot it draws."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tools.plot_losses import main, parse_log, parse_log_lines, plot_runs, read_tensorboard_run

# Verbatim lines in the format the training loop prints (the public log interface).
RUN_LINE = (
    " > megatron-fp8 run: fp8-recipe=bf16 fp8-param-gather=False use-megatron-fsdp=False "
    "data-parallel-size=1"
)
SAMPLE_ITERATION_LINE = (
    " [2026-11-30 05:00:00] iteration       10/     200 | consumed samples:          160 | "
    "elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 0.5 | "
    "tokens per GPU (tokens/s/GPU): 1234.5 | learning rate: 3.000000E-04 | global batch size:"
    "    16 | lm loss: 5.123456E+00 | grad norm: 1.234 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 | mem allocated (GiB): 0.12 |"
)
SAMPLE_VALIDATION_LINE = (
    " validation loss at iteration 100 | lm loss value: 4.123456E+00 | lm loss PPL: 6.172345E+01 |"
)


def iteration_line(iteration: int, loss: float, grad_norm: float, tflops: float) -> str:
    return (
        f" [2026-11-30 05:00:{iteration % 60:02d}] iteration {iteration:8d}/     200 | "
        f"consumed samples: {iteration * 16:12d} | elapsed time per iteration (ms): 100.0 | "
        f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f} | tokens per GPU (tokens/s/GPU): 512.0 | "
        f"learning rate: 1.000000E-03 | global batch size:    16 | lm loss: {loss:E} | "
        f"grad norm: {grad_norm:.3f} | number of skipped iterations:   0 | "
        "number of nan iterations:   0 | mem allocated (GiB): 0.50 |"
    )


def write_log(path: Path, recipe: str, losses: list[float]) -> Path:
    lines = ["some startup output", RUN_LINE.replace("bf16", recipe)]
    for index, loss in enumerate(losses):
        lines.append(iteration_line(10 * (index + 1), loss, 1.5 + index, 2.0 * (index + 1)))
    lines.append(
        " validation loss at iteration 20 | lm loss value: 3.500000E+00 | "
        "lm loss PPL: 3.311545E+01 |"
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parse_log_reads_every_field_of_the_sample_lines() -> None:
    run = parse_log_lines(
        [RUN_LINE, SAMPLE_ITERATION_LINE, SAMPLE_VALIDATION_LINE], source="sample.log"
    )
    assert run.label == "bf16"
    assert run.settings == {
        "fp8-recipe": "bf16",
        "fp8-param-gather": "False",
        "use-megatron-fsdp": "False",
        "data-parallel-size": "1",
    }
    assert run.data_parallel_size == 1
    assert run.iterations == [10]
    assert run.series == {
        "consumed-samples": [160.0],
        "iteration-time": [pytest.approx(0.1234, rel=1e-12)],
        "throughput/tflops-per-gpu": [0.5],
        "throughput/tokens-per-sec-per-gpu": [1234.5],
        "learning-rate": [3e-4],
        "batch-size": [16.0],
        "lm loss": [5.123456],
        "grad-norm": [1.234],
        "skipped-iterations": [0.0],
        "nan-iterations": [0.0],
        "mem-allocated-bytes": [pytest.approx(0.12 * 2**30, rel=1e-12)],
    }
    assert run.validation_iterations == [100]
    assert run.validation_series == {
        "lm loss validation": [4.123456],
        "lm loss validation ppl": [61.72345],
    }


def test_parse_log_keeps_the_later_line_of_a_resumed_iteration() -> None:
    lines = [iteration_line(10, 5.0, 1.0, 1.0), iteration_line(20, 4.0, 1.0, 1.0)]
    lines += [iteration_line(20, 3.75, 1.0, 1.0), iteration_line(30, 3.5, 1.0, 1.0)]
    run = parse_log_lines(lines, source="resumed.log", label="resumed")
    assert run.iterations == [10, 20, 30]
    assert run.series["lm loss"] == [5.0, 3.75, 3.5]
    assert run.label == "resumed"


def test_parse_log_without_iteration_lines_names_the_problem(tmp_path: Path) -> None:
    empty_log = tmp_path / "empty.log"
    empty_log.write_text(RUN_LINE + "\nTraceback (most recent call last):\n")
    with pytest.raises(ValueError, match="has no training iteration lines"):
        parse_log(str(empty_log))


def test_plot_runs_draws_one_line_per_run_with_its_data(tmp_path: Path) -> None:
    bf16 = parse_log(str(write_log(tmp_path / "bf16.log", "bf16", [6.0, 5.0, 4.5])))
    mxfp8 = parse_log(str(write_log(tmp_path / "mxfp8.log", "mxfp8", [6.25, 5.25, 4.75])))
    output = tmp_path / "plots" / "losses.png"
    figure = plot_runs(
        [bf16, mxfp8],
        output=str(output),
        metrics=["lm loss", "grad-norm", "throughput/tflops-per-gpu", "lm loss validation"],
    )
    from matplotlib.image import imread

    assert imread(str(output)).shape == (4 * 400, 1000, 4)  # rows, columns, RGBA
    expected = {
        "lm loss": {"bf16": [6.0, 5.0, 4.5], "mxfp8": [6.25, 5.25, 4.75]},
        "grad-norm": {"bf16": [1.5, 2.5, 3.5], "mxfp8": [1.5, 2.5, 3.5]},
        "throughput/tflops-per-gpu": {"bf16": [2.0, 4.0, 6.0], "mxfp8": [2.0, 4.0, 6.0]},
        "lm loss validation": {"bf16": [3.5], "mxfp8": [3.5]},
    }
    assert [axis.get_ylabel() for axis in figure.axes] == list(expected)
    for axis, (metric, by_label) in zip(figure.axes, expected.items()):
        lines = axis.get_lines()
        assert [line.get_label() for line in lines] == ["bf16", "mxfp8"]
        assert [text.get_text() for text in axis.get_legend().get_texts()] == ["bf16", "mxfp8"]
        x_expected = [20] if metric == "lm loss validation" else [10, 20, 30]
        for line in lines:
            assert list(line.get_xdata()) == x_expected
            assert list(line.get_ydata()) == by_label[line.get_label()]


def test_plot_runs_rejects_a_missing_metric(tmp_path: Path) -> None:
    run = parse_log_lines([SAMPLE_ITERATION_LINE], source="x.log", label="x")
    with pytest.raises(ValueError, match="run 'x' has no 'lm loss validation' series"):
        plot_runs([run], output=str(tmp_path / "x.png"), metrics=["lm loss validation"])


def test_cli_labels_panels_and_duplicate_recipes(tmp_path: Path) -> None:
    first = write_log(tmp_path / "a.log", "mxfp8", [6.0, 5.5, 5.0])
    second = write_log(tmp_path / "b.log", "mxfp8", [6.5, 6.0, 5.5])
    output = tmp_path / "cli.png"
    figure = main([str(first), str(second), "--output", str(output), "--grad-norm", "--throughput"])
    from matplotlib.image import imread

    assert imread(str(output)).shape == (3 * 400, 1000, 4)
    assert [axis.get_ylabel() for axis in figure.axes] == [
        "lm loss",
        "grad-norm",
        "throughput/tflops-per-gpu",
    ]
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["mxfp8 (a.log)", "mxfp8 (b.log)"]
    figure = main([str(first), str(second), "--output", str(output), "--labels", "run A", "run B"])
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["run A", "run B"]
    assert imread(str(output)).shape == (400, 1000, 4)
    with pytest.raises(SystemExit):
        main([str(first), "--output", str(output), "--labels", "one", "two"])


def test_tensorboard_dir_gives_the_same_series_as_the_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    from megatron.training.loggers import MetricsLogger

    with MetricsLogger(
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        run_config={},
        enabled=True,
    ) as logger:
        for iteration, loss in [(10, 6.0), (20, 5.5), (30, 5.25)]:
            logger.log_scalars(iteration, {"lm loss": loss, "grad-norm": iteration / 8})
        logger.log_scalars(30, {"lm loss validation": 5.5})
    run = read_tensorboard_run(str(tmp_path / "tb"))
    assert run.label == "tb"
    assert run.iterations == [10, 20, 30]
    assert run.series == {"grad-norm": [1.25, 2.5, 3.75], "lm loss": [6.0, 5.5, 5.25]}
    assert (run.validation_iterations, run.validation_series) == (
        [30],
        {"lm loss validation": [5.5]},
    )
    assert not any(math.isnan(value) for value in run.series["lm loss"])


def test_cli_without_matplotlib_prints_one_line(tmp_path: Path) -> None:
    """No traceback: one `error:` line naming the package and the install command, status 1,
    before any log is read (the missing log file below is never opened)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    hide_matplotlib = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = ['plot_losses.py', {str(tmp_path / 'absent.log')!r}, '--output', "
        f"{str(tmp_path / 'out.png')!r}]; "
        "runpy.run_path('tools/plot_losses.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide_matplotlib],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: plotting needs matplotlib")
    assert "pip install matplotlib" in lines[0]
    assert not (tmp_path / "out.png").exists()


def test_a_run_without_fp8_is_labelled_by_its_dtype(capsys) -> None:
    """The default run trains in fp32: its run line and the plot legend say so (not bf16)."""
    from tests.unit_tests.training.common import TINY_GPT, run_pretrain

    capsys.readouterr()
    run_pretrain(TINY_GPT + ["--train-iters", "1"])
    out = capsys.readouterr().out
    assert " > megatron-fp8 run: fp8-recipe=none params-dtype=float32 " in out
    assert parse_log_lines(out.splitlines(), source="log").label == "float32"
    run_line = RUN_LINE.replace("fp8-recipe=bf16", "fp8-recipe=none params-dtype=bfloat16")
    assert parse_log_lines([run_line, SAMPLE_ITERATION_LINE], source="log").label == "bfloat16"
    assert parse_log_lines([RUN_LINE, SAMPLE_ITERATION_LINE], source="log").label == "bf16"
