"""--log-fp8-stats and --log-fp8-stats-interval: our flags (Megatron-LM core_v0.19.0 has none for
this) for the FP8 statistics that megatron/training/fp8_stats.py collects and logs."""

from __future__ import annotations

import argparse


def add_fp8_stats_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FP8 statistics")
    group.add_argument(
        "--log-fp8-stats",
        action="store_true",
        help="Every --log-fp8-stats-interval iterations, per FP8 Linear and role (input, weight, "
        "grad): amax, scale, fractions that saturate and flush to zero (docs/FP8_NUMERICS.md).",
    )
    group.add_argument(
        "--log-fp8-stats-interval", type=int, default=100, help="Iterations per FP8 statistics."
    )
