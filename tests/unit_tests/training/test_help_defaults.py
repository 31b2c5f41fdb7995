"""`pretrain_gpt.py --help` shows the default of every flag (a new user reads them there)."""

import argparse
import os
import re
import subprocess
import sys

from megatron.training.flags.arguments import build_parser

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_every_flag_help_ends_with_its_default():
    parser = build_parser()
    formatter = parser._get_formatter()
    missing = []
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        checked += 1
        text = formatter._expand_help(action)
        if f"(default: {action.default})" not in text:
            missing.append((action.option_strings[0], text))
    assert checked > 90, checked  # every flag, not an empty loop
    assert not missing, missing


def test_rendered_help_shows_defaults():
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # undo the line wrapping
    for flag, default in (
        ("--log-interval LOG_INTERVAL", "100"),
        ("--fp8-amax-history-len FP8_AMAX_HISTORY_LEN", "1"),
        ("--fp8-amax-compute-algo {max,most_recent}", "most_recent"),
        # Resolved at parse time from the engine flags; the help text says to what.
        (
            "--data-parallel-sharding-strategy {no_shard,optim,optim_grads,optim_grads_params}",
            "None",
        ),
        ("--check-for-nan-in-loss-and-grad, --no-check-for-nan-in-loss-and-grad", "True"),
        ("--swiglu", "False"),
    ):
        start = text.index(flag, text.index("options:"))  # its entry, not the usage line
        match = re.compile(r"\(default: ([^)]*)\)").search(text, start)
        assert match is not None, flag
        assert match.group(1) == default, (flag, match.group(1))
    assert "Default optim_grads_params with --use-megatron-fsdp, optim with" in text
