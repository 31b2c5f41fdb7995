"""Export a megatron-fp8 checkpoint to HuggingFace: an alias of

    python3 tools/checkpoint/convert.py --loader megatron_fp8 --saver hf \\
        --load-dir CKPT_DIR [--iteration N] --save-dir HF_DIR --dtype float32

kept for its command line:

    python3 tools/checkpoint/convert_to_hf.py --load CKPT_DIR [--iteration N] --output HF_DIR

The export itself (architectures, mapping, the .tmp-then-rename write) is in hf_export.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

if __package__ in (None, ""):
    # Run as a script: make the repository root importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.checkpoint import convert  # noqa: E402
from tools.checkpoint.hf_export import (  # noqa: E402, F401 - the names this module exported
    UnsupportedArchitectureError,
    check_gpt2_exportable,
    check_llama_exportable,
    check_state_dict,
    convert_state_dict_to_hf,
    gpt2_state_dict,
    hf_architecture,
    llama_state_dict,
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a megatron-fp8 checkpoint to HuggingFace.")
    parser.add_argument("--load", required=True, help="--save directory or an iter_XXXXXXX dir")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--output", required=True, help="HuggingFace model directory to write")
    parser.add_argument("--dtype", choices=convert.DTYPES, default="float32", help="weight dtype")
    args = parser.parse_args(argv)
    forwarded = ["--loader", "megatron_fp8", "--saver", "hf", "--load-dir", args.load]
    forwarded += ["--save-dir", args.output, "--dtype", args.dtype]
    if args.iteration is not None:
        forwarded += ["--iteration", str(args.iteration)]
    convert.main(forwarded)


if __name__ == "__main__":
    main()
