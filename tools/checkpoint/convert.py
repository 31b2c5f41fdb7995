"""Convert GPT checkpoints between HuggingFace, Megatron-LM and megatron-fp8 (Megatron-LM's CLI):

    python tools/checkpoint/convert.py --loader hf --saver megatron_fp8 \\
        --load-dir HF_DIR --save-dir CKPT_DIR
    python pretrain_gpt.py --load CKPT_DIR --finetune --use-checkpoint-args <data flags> ...

Loaders and savers (the registry below): `hf` (Llama incl. GQA, RoPE base, tied or untied head;
GPT-2; DeepSeek-V3, Mixtral and Qwen3-MoE: hf_moe_configs.py, hf_moe_layout.py), `mcore`
(Megatron-LM `torch_dist` checkpoints of dense GPT models), `megatron_fp8` (ours, any
--ckpt-format; the routers' expert biases travel as model_buffers.pt). Every
conversion passes through one representation, our GPTModel's state dict plus its
TransformerConfig (model_state.py), checked against the model before anything is written.
Model flags come from the source where it records them (config.json, Megatron-LM's saved args,
our metadata.json); a Megatron-LM checkpoint without args takes them from this
command line, with Megatron's flag names. The output is written to SAVE_DIR.tmp and renamed
when complete. Bad input (another architecture, a missing, extra or misshapen tensor, an unknown
format) prints one `error:` line naming the tensor or file and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

if __package__ in (None, ""):
    # Run as a script: make the repository root importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron.core.checkpoint_files import CheckpointError  # noqa: E402
from megatron.training.flags.arguments import build_parser as build_pretrain_parser  # noqa: E402
from tools.checkpoint.hf_export import (  # noqa: E402
    UnsupportedArchitectureError,
    check_output_dir,
    convert_state_dict_to_hf,
)
from tools.checkpoint.hf_import import load_hf  # noqa: E402
from tools.checkpoint.hf_tokenizer import saved_args, tokenizer_writer  # noqa: E402
from tools.checkpoint.mcore import load_mcore, save_mcore  # noqa: E402
from tools.checkpoint.megatron_fp8 import load_megatron_fp8, save_megatron_fp8  # noqa: E402
from tools.checkpoint.model_flags import add_model_flags, check_given_flags  # noqa: E402
from tools.checkpoint.model_state import (  # noqa: E402
    ConversionError,
    ModelState,
    check_new_output_dir,
)


def _load_hf(args: argparse.Namespace, given: dict) -> ModelState:
    return load_hf(args.load_dir)


def _load_mcore(args: argparse.Namespace, given: dict) -> ModelState:
    return load_mcore(args.load_dir, given)


def _load_megatron_fp8(args: argparse.Namespace, given: dict) -> ModelState:
    return load_megatron_fp8(args.load_dir, args.iteration)


DTYPES = ("float32", "bfloat16", "float16")


def _save_hf(state: ModelState, args: argparse.Namespace) -> str:
    dtype = getattr(torch, args.dtype) if args.dtype else state.config.params_dtype
    writer, tokenizer = None, ""
    try:
        if args.loader == "megatron_fp8":  # the tokenizer the checkpoint was trained with
            writer, tokenizer = tokenizer_writer(saved_args(args.load_dir, args.iteration))
        hf_config = convert_state_dict_to_hf(
            state.state_dict,
            state.config,
            output_dir=args.save_dir,
            dtype=dtype,
            write_extra=writer,
        )
    except (UnsupportedArchitectureError, FileExistsError, FileNotFoundError) as error:
        raise ConversionError(str(error)) from None
    if tokenizer:
        print(f"{args.save_dir}: {tokenizer}")
    return f"{hf_config['architectures'][0]} ({str(dtype).removeprefix('torch.')})"


def _save_mcore(state: ModelState, args: argparse.Namespace) -> str:
    save_mcore(state, args.save_dir)
    return "Megatron-LM torch_dist checkpoint"


def _save_megatron_fp8(state: ModelState, args: argparse.Namespace) -> str:
    save_megatron_fp8(state, args.save_dir, ckpt_format=args.ckpt_format)
    return f"megatron-fp8 checkpoint (--ckpt-format {args.ckpt_format})"


def _check_hf_output(path: str) -> None:
    try:
        check_output_dir(path)  # a previous HF export there may be replaced, nothing else
    except FileExistsError as error:
        raise ConversionError(str(error)) from None


@dataclass(frozen=True)
class Format:
    load: Callable[[argparse.Namespace, dict], ModelState]
    save: Callable[[ModelState, argparse.Namespace], str]
    check_output: Callable[[str], None] = check_new_output_dir


FORMATS: dict[str, Format] = {
    "hf": Format(_load_hf, _save_hf, _check_hf_output),
    "mcore": Format(_load_mcore, _save_mcore),
    "megatron_fp8": Format(_load_megatron_fp8, _save_megatron_fp8),
}


def _ckpt_formats() -> list[str]:
    """pretrain_gpt.py's --ckpt-format choices: the saver writes any format training reads."""
    (action,) = [a for a in build_pretrain_parser()._actions if "--ckpt-format" in a.option_strings]
    return list(action.choices)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert.py",
        description="Convert GPT checkpoints between hf, mcore (Megatron-LM) and megatron_fp8.",
        allow_abbrev=False,
    )
    parser.add_argument("--loader", required=True, choices=sorted(FORMATS), help="Input format.")
    parser.add_argument("--saver", required=True, choices=sorted(FORMATS), help="Output format.")
    parser.add_argument("--load-dir", required=True, help="Checkpoint or model dir to read.")
    parser.add_argument("--save-dir", required=True, help="Directory to write (new or empty).")
    parser.add_argument(
        "--iteration", type=int, default=None, help="megatron_fp8 loader: default the latest."
    )
    parser.add_argument(
        "--ckpt-format",
        choices=_ckpt_formats(),
        default="torch",
        help="megatron_fp8 saver: the format pretrain_gpt.py will --load (sharded formats are "
        "written as Megatron-FSDP writes them).",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="hf saver: weight dtype (default: source's)."
    )
    add_model_flags(parser)
    return parser


def convert(argv: Sequence[str] | None = None) -> str:
    """Run one conversion; returns the line printed on success. Raises ConversionError."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {
        dest: getattr(args, dest)
        for dest in vars(args)
        if dest not in ("loader", "saver", "load_dir", "save_dir", "iteration")
        and dest not in ("ckpt_format", "dtype")
    }
    # (flag, its value, its default, the loader or saver it belongs to, the one chosen)
    for flag, value, default, owner, chosen in (
        ("--iteration", args.iteration, None, "megatron_fp8 loader", f"{args.loader} loader"),
        ("--ckpt-format", args.ckpt_format, "torch", "megatron_fp8 saver", f"{args.saver} saver"),
        ("--dtype", args.dtype, None, "hf saver", f"{args.saver} saver"),
    ):
        if value != default and owner != chosen:
            raise ConversionError(f"{flag} applies to the {owner} only; drop it")
    if not os.path.exists(args.load_dir):
        raise ConversionError(f"--load-dir {args.load_dir} does not exist")
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConversionError("--save-dir must differ from --load-dir")
    saver = FORMATS[args.saver]
    saver.check_output(args.save_dir)  # before the (possibly long) load
    try:
        state = FORMATS[args.loader].load(args, given)
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    check_given_flags(state.config, given, source=f"the {args.loader} checkpoint")
    written = saver.save(state, args)
    # Which saved iteration a megatron_fp8 source gave (the tracker's unless --iteration).
    source = ""
    if args.loader == "megatron_fp8":
        source = f" from iteration {state.iteration} of {args.load_dir}"
    return f"wrote {written}{source} to {args.save_dir}"


def main(argv: Sequence[str] | None = None) -> None:
    try:
        print(convert(argv), flush=True)
    except (ConversionError, ImportError) as error:
        if os.environ.get("MEGATRON_TRACEBACK") == "1":
            raise
        sys.stdout.flush()
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
