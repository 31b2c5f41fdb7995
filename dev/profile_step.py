"""Investigation helper: `pretrain_gpt.py` with its torch.profiler trace written to a folder of
your choice, for machines without the tensorboard package (Megatron-LM's
`--use-pytorch-profiler` writes the trace next to `--tensorboard-dir`, whose writer needs it).

    PROF_DIR=/tmp/prof torchrun --nproc-per-node 1 dev/profile_step.py <pretrain_gpt.py flags> \\
        --profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 7
    python dev/trace_summary.py /tmp/prof/rank-0.json.gz --top 50        # GPU time by kernel
    python dev/trace_summary.py /tmp/prof/rank-0.json.gz --top 60 --cpu  # host time by op

It only replaces the trace folder and the check that asks for --tensorboard-dir; everything
else is pretrain_gpt.py as the flags say.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.training import run_hooks  # noqa: E402
from megatron.training.flags import megatron_lm_checks  # noqa: E402


def main() -> None:
    trace_dir = os.environ.get("PROF_DIR")
    if not trace_dir:
        raise SystemExit("dev/profile_step.py: set PROF_DIR to the folder for the trace")
    checked = megatron_lm_checks._validate_profiling

    def validate(args):
        if args.use_pytorch_profiler and not args.tensorboard_dir:
            args.tensorboard_dir = trace_dir  # satisfies the check; no writer is made of it
            checked(args)
            args.tensorboard_dir = None
        else:
            checked(args)

    megatron_lm_checks._validate_profiling = validate
    run_hooks.torch_profile_dir = lambda _tensorboard_dir: trace_dir
    sys.argv = [str(ROOT / "pretrain_gpt.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
