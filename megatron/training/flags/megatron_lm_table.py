"""Every other flag of Megatron-LM's parser (release core_v0.19.0), so none is "unrecognized".

megatron_lm_core_v0.19.0.tsv (package data, written by dev/dump_megatron_lm_flags.py) lists each
option string of Megatron-LM's `arguments.py` with its number of values and its default. The
ones no other module defines are added here, hidden from --help (one help line names the table).
Given on a command line, such a flag is
- accepted with one log note when it belongs to a family of pure performance, logging or
  launcher knobs of Megatron-LM's implementation (NO_EFFECT_FAMILIES: results do not change),
  when its value is exactly Megatron-LM's default, or when Megatron-LM accepts it only where it
  changes nothing and that holds (CONDITIONAL; where it does not, it is refused as there);
- otherwise named in the one exit-2 "not built" message (megatron_lm.unbuilt_features).
Parse-time code: it reads the argparse Namespace before configs.build_run_config.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os

from megatron.training.flags import recompute

RELEASE = "core_v0.19.0"
TABLE = os.path.join(os.path.dirname(__file__), f"megatron_lm_{RELEASE}.tsv")
GIVEN = "megatron_lm_table_given"  # Namespace attribute: ((flag, values, default repr), ...)

# (flag prefixes, why such a flag changes no result here). A prefix ends where a flag name's
# word ends ("--log-" matches "--log-energy"); a full flag name matches only itself.
NO_EFFECT_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        (
            "--log-",
            "--wandb-",
            "--tensorboard-queue-size",
            "--one-logger-",
            "--no-one-logger",
            "--app-tag-",
            "--config-logger-dir",
            "--timing-log-option",
            "--no-barrier-with-level-1-timing",
            "--disable-log-loss-scale-to-tensorboard",
            "--no-log-loss-scale-to-tensorboard",
        ),
        "a logging switch of Megatron-LM's loggers; this run logs its own lines and series",
    ),
    (
        ("--pytorch-profiler-", "--record-shapes", "--nvtx-ranges"),
        "a profiler detail; --profile --use-pytorch-profiler here records its own trace",
    ),
    (
        (
            "--no-bias-dropout-fusion",
            "--no-bias-gelu-fusion",
            "--no-bias-swiglu-fusion",
            "--no-masked-softmax-fusion",
            "--no-persist-layer-norm",
            "--no-rope-fusion",
            "--no-gradient-reduce-div-fusion",
            "--disable-jit-fuser",
            "--use-flash-attn",
            "--flash-attention-version",
            "--moe-router-fusion",
        ),
        "a kernel choice of Megatron-LM's (fused or unfused, same math); the layers here are "
        "our own PyTorch modules",
    ),
    (
        (
            "--ddp-bucket-size",
            "--ddp-num-buckets",
            "--ddp-pad-buckets-for-high-nccl-busbw",
            "--no-align-grad-reduce",
            "--disable-align-grad-reduce",
            "--no-align-param-gather",
            "--nccl-communicator-config-path",
            "--disable-symmetric-registration",
            "--use-sharp",
            "--sharp-enabled-group",
            "--create-all-gather-group",
            "--high-priority-stream-groups",
            "--disable-gloo-process-groups",
            "--distributed-timeout-seconds-after-init",
        ),
        "a communication scheduling knob (buckets, streams, NCCL set-up); it changes speed, "
        "never the reduced values",
    ),
    (
        (
            "--ckpt-assume-constant-structure",
            "--ckpt-fully-parallel-",
            "--async-ckpt-",
            "--async-strategy",
            "--dist-ckpt-workers",
            "--disable-ckpt-load-validate-sharding-integrity",
            "--no-ckpt-load-validate-sharding-integrity",
        ),
        "a checkpoint I/O knob of Megatron-LM's dist-checkpointing; checkpoints here are "
        "written and read by our own code, same contents",
    ),
    (
        (
            "--flight-recorder-",
            "--disable-flight-recorder-",
            "--no-flight-recorder-",
            "--straggler-",
            "--disable-straggler-on-startup",
        ),
        "a debugging/monitoring aid of Megatron-LM (NCCL flight recorder, straggler detector)",
    ),
    (
        (
            "--num-dataset-builder-threads",
            "--dataloader-defer-npy-index-mmap",
            "--dataloader-fast-cache-load",
        ),
        "a data-loading speed knob; the tokens read are the same",
    ),
    (
        (
            "--enable-cuda-graph",
            "--cuda-graph-",
            "--external-cuda-graph",
            "--keep-fp8-transpose-cache",
        ),
        "a CUDA-graph or cache knob of TransformerEngine (speed and memory only)",
    ),
    (
        ("--disable-manual-gc-eval", "--no-manual-gc-eval"),
        "when --manual-gc collects around evaluation (timing only)",
    ),
    (("--local-rank",), "the launcher's rank; torchrun's environment gives it here"),
    (
        ("--mup-width-mult",),
        "Megatron-LM overwrites it with --hidden-size / --mup-base-hidden-size, as here",
    ),
)

_EP_OVERLAP = "--overlap-moe-expert-parallel-comm"
_SHARED_OVERLAP = "--moe-shared-expert-overlap"


def _refused(without: list[tuple[bool, str]], with_: list[tuple[bool, str]]) -> str | None:
    """Megatron-LM's refusal of a conditional flag: the settings it needs that are missing
    (without) and the ones it refuses that are given (with_), or None."""
    parts = [f"without {need}" for holds, need in without if not holds]
    parts += [f"with {given}" for holds, given in with_ if holds]
    return "Megatron-LM refuses it " + "; ".join(parts) if parts else None


def _no_position_embedding_problem(args) -> str | None:
    if args.position_embedding_type == "rope":
        return None
    return (
        "deprecated in Megatron-LM, which refuses it unless --position-embedding-type is rope: "
        "choose the embedding with --position-embedding-type"
    )


def _ep_overlap_problem(args) -> str | None:
    without = [
        (args.expert_model_parallel_size > 1, "--expert-model-parallel-size above 1"),
        (
            args.moe_token_dispatcher_type in ("alltoall", "flex"),
            "--moe-token-dispatcher-type alltoall (or flex)",
        ),
        (args.bf16 or args.fp16, "--bf16 (or --fp16)"),
    ]
    given = {flag for flag, _, _ in table_flags_given(args)}
    with_ = [
        (recompute.granularity(args) == "full", "--recompute-granularity full"),
        ("moe" in recompute.modules(args), "--recompute-modules moe"),
        ((args.mtp_num_layers or 0) > 1, "--mtp-num-layers above 1"),
        (_SHARED_OVERLAP in given, _SHARED_OVERLAP),  # with shared experts or not
    ]
    return _refused(without, with_)


def _shared_overlap_problem(args) -> str | None:
    if args.moe_shared_expert_intermediate_size is None:  # Megatron-LM: no effect, no check
        return None
    without = [
        (
            args.moe_token_dispatcher_type in ("alltoall", "flex"),
            "--moe-token-dispatcher-type alltoall (or flex)",
        ),
    ]
    given = {flag for flag, _, _ in table_flags_given(args)}
    with_ = [
        (
            recompute.granularity(args) == "selective"
            and "shared_experts" in recompute.modules(args),
            "selective --recompute-modules shared_experts",
        ),
        (_EP_OVERLAP in given, _EP_OVERLAP),
    ]
    return _refused(without, with_)


def _delay_wgrad_problem(args) -> str | None:
    given = {flag for flag, _, _ in table_flags_given(args)}
    impl = args.transformer_impl  # None: Megatron-LM's default, transformer_engine
    return _refused(
        [(_EP_OVERLAP in given, _EP_OVERLAP)],
        [(impl not in (None, "transformer_engine"), f"--transformer-impl {impl}")],
    )


def _op_fuser_problem(args) -> str | None:
    # Megatron-LM's fused grouped MLP asserts a gated activation (of ours: SwiGLU) at build.
    moe_grouped = bool(args.num_experts) and args.moe_grouped_gemm
    return _refused([(args.swiglu or not moe_grouped, "--swiglu (grouped MoE experts)")], [])


# Table flags that Megatron-LM's validation accepts only under conditions, and that change
# nothing here where it accepts them: flag -> (why it changes nothing; the Namespace's
# problem in Megatron-LM's terms, or None where Megatron-LM accepts it). Not mirrored:
# conditions on flags not built here (pipeline stages, CUDA-graph scopes, TE versions).
CONDITIONAL: dict[str, tuple] = {
    "--no-position-embedding": (
        "Megatron-LM allows this deprecated switch only with --position-embedding-type rope, "
        "and rope has no learned position embedding to drop",
        _no_position_embedding_problem,
    ),
    _EP_OVERLAP: (
        "a schedule of Megatron-LM's (one micro-batch's expert-parallel all-to-all overlapped "
        "with another's compute): speed only, same math; here the all-to-alls run in order",
        _ep_overlap_problem,
    ),
    _SHARED_OVERLAP: (
        "a schedule of Megatron-LM's (the shared experts computed while the dispatcher's "
        "all-to-all is in flight): speed only, the same values up to the order in which the "
        "hidden state's gradient sums its parts; here the shared experts run after the routed "
        "experts' combine",
        _shared_overlap_problem,
    ),
    "--delay-wgrad-compute": (
        "a schedule of Megatron-LM's (the layers' weight gradients, attention and MLP or "
        "experts, computed later to overlap the all-to-all): speed only, the same gradients",
        _delay_wgrad_problem,
    ),
    "--use-transformer-engine-op-fuser": (
        "a kernel choice of TransformerEngine's (its operation fuser, same math); the layers "
        "here are our own PyTorch modules",
        _op_fuser_problem,
    ),
}

_NARGS = {"0": 0, "1": None, "?": "?", "*": "*", "+": "+"}


@functools.lru_cache(maxsize=1)
def read_table() -> tuple[tuple[str, str, str], ...]:
    """(flag, number of values, default repr) of every row of the table."""
    with open(TABLE, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle if line.strip()]
    return tuple(tuple(line.split("\t")) for line in lines if not line.startswith("#"))


class _Given(argparse.Action):
    """Records (flag, values, default repr) of a table flag that is given."""

    def __init__(self, *args, table_default: str, **kwargs):
        self.table_default = table_default
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        given = tuple(getattr(namespace, self.dest) or ())
        setattr(namespace, self.dest, (*given, (option_string, values, self.table_default)))


def add_megatron_lm_table_args(parser: argparse.ArgumentParser) -> None:
    """Add every table flag no other module defined (call it after all other flags)."""
    missing = [row for row in read_table() if row[0] not in parser._option_string_actions]
    group = parser.add_argument_group(
        f"other Megatron-LM {RELEASE} flags",
        f"The {len(missing)} other flags of Megatron-LM {RELEASE}'s arguments.py (table: "
        f"megatron/training/flags/megatron_lm_{RELEASE}.tsv, docs/MEGATRON_LM_FLAGS.md) are "
        "accepted but not listed: a performance or logging knob, or a value equal to "
        "Megatron-LM's default, is logged as having no effect here; any other is refused as not "
        "built.",
    )
    for flag, arity, default in missing:
        nargs = _NARGS[arity] if arity in _NARGS else int(arity)
        group.add_argument(
            flag,
            action=_Given,
            dest=GIVEN,
            nargs=nargs,
            default=None,
            table_default=default,
            metavar="V",
            help=argparse.SUPPRESS,
        )


def no_effect_reason(flag: str, args: argparse.Namespace) -> str | None:
    if flag in CONDITIONAL:
        reason, problem = CONDITIONAL[flag]
        return None if problem(args) else reason
    for prefixes, reason in NO_EFFECT_FAMILIES:
        if any(flag == p or (p.endswith("-") and flag.startswith(p)) for p in prefixes):
            return reason
    return None


def is_megatron_lm_default(values, default_repr: str) -> bool:
    """Whether the given value(s) equal Megatron-LM's default (a flag without values never
    does: giving it flips the default)."""
    if values is None or (isinstance(values, list) and not values):
        return False
    try:
        default = ast.literal_eval(default_repr)
    except (ValueError, SyntaxError):
        return False
    if isinstance(values, list):
        if not isinstance(default, (list, tuple)) or len(default) != len(values):
            return False
        return all(_same(value, item) for value, item in zip(values, default))
    return _same(values, default)


def _same(value: str, default) -> bool:
    if default is None:
        return False
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == str(default)


def table_flags_given(args: argparse.Namespace) -> tuple[tuple[str, object, str], ...]:
    return tuple(getattr(args, GIVEN, None) or ())


def unbuilt_table_flags(args: argparse.Namespace) -> list[str]:
    """The given table flags that change something we have not built, as written (a
    conditional one with Megatron-LM's fix)."""
    return [
        f"{flag} ({CONDITIONAL[flag][1](args)})" if flag in CONDITIONAL else _written(flag, values)
        for flag, values, default in table_flags_given(args)
        if no_effect_reason(flag, args) is None and not is_megatron_lm_default(values, default)
    ]


def table_notes(args: argparse.Namespace) -> list[str]:
    """One log note per given table flag that is accepted, saying why it has no effect."""
    notes = []
    for flag, values, default in table_flags_given(args):
        reason = no_effect_reason(flag, args)
        if reason is None and is_megatron_lm_default(values, default):
            reason = f"Megatron-LM's default ({default}), which is what runs here"
        if reason is not None:
            notes.append(f"{_written(flag, values)}: no effect here: {reason}.")
    return notes


def _written(flag: str, values) -> str:
    if values is None:
        return flag
    if isinstance(values, list):
        return " ".join((flag, *values)) if values else flag
    return f"{flag} {values}"
