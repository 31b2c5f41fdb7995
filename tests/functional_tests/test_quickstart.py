"""The README's train command on the real corpus (shortened to 100 iterations for CI time): it
trains, logs, and its validation loss ends at least 30% below the first logged training loss."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_learns(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/quickstart.sh", "--train-iters", "100", "--lr-warmup-iters", "10",
         "--eval-interval", "100"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OUTPUT_DIR": str(tmp_path / "quickstart")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    valid = [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", proc.stdout)]
    assert len(train) == 5 and len(valid) == 1  # log every 20 iterations, one final evaluation
    assert valid[-1] <= 0.7 * train[0], (train, valid)
    assert os.path.isdir(tmp_path / "quickstart" / "checkpoints" / "iter_0000100")
