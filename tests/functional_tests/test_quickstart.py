"""The README's train command on the real corpus (shortened to 100 iterations for CI time): it
trains, logs, and its validation loss ends at least 30% below the first logged training loss;
its run directory holds the checkpoint and a train.log that tools/plot_losses.py reads."""

import os
import re
import subprocess

from tools.plot_losses import parse_log

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_learns(tmp_path):
    proc = subprocess.run(
        [
            "bash",
            "scripts/quickstart.sh",
            "--train-iters",
            "100",
            "--lr-warmup-iters",
            "10",
            "--eval-interval",
            "100",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OUTPUT_DIR": str(tmp_path / "quickstart")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    valid = [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", proc.stdout)]
    assert len(train) == 5 and len(valid) == 1  # log every 20 iterations, one final evaluation
    assert valid[-1] <= 0.7 * train[0], (train, valid)
    # The run directory is named by the extra flags, so another flag set gets another one.
    run_dir = tmp_path / "quickstart" / "train-iters_100_lr-warmup-iters_10_eval-interval_100"
    assert os.path.isdir(run_dir / "checkpoints" / "iter_0000100")
    # One torch thread unless the caller chose (the default that holds up under contention).
    assert f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}" in proc.stdout
    run = parse_log(str(run_dir / "train.log"))  # what the README's plot command reads
    assert run.iterations == [20, 40, 60, 80, 100]
    assert run.series["lm loss"] == train
    assert run.validation_series["lm loss validation"] == valid
    assert run.recipe == "none" and run.settings["params-dtype"] == "float32"  # fp32, no FP8
