"""Eager passes of many elementwise ops run as a few fused kernels on CUDA: `fused(fn)`.

A pass that runs outside any compiled graph (the FP8 statistics of a statistics step; the
routed experts' token and weight quantization under delayed scaling, eager on host counts)
would otherwise launch one kernel per torch op, each reading and writing a full-size tensor.
`fused` compiles fn once with dynamic shapes (token counts change every step) where `fused_on`
says so, and calls fn itself inside a graph being traced (the caller's compile inlines it) and
elsewhere. The values are the eager ones, bit for bit: on CPU with the compile forced, and on
CUDA in the GPU twins (fp32 divisions, approximate in Inductor's Triton code, are written as
fp64 divisions rounded once: `fp8.reference.reciprocal`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch


def fused_on(device: torch.device) -> bool:
    """Whether a pass on device runs compiled (CUDA); elsewhere eager, where the CPU's compile
    time would outweigh what it saves."""
    return device.type == "cuda"


def fused(fn: Callable) -> Callable:
    """fn(x, *args, **kwargs) compiled where `fused_on(x.device)` (dynamic shapes, its own
    stance: statistics steps run force_eager; its own recompile limit: every recipe, role and
    dtype in one process took 60 graphs); a failed compile warns once, naming the chained
    cause, and fn runs eagerly after."""
    compiled, failed = torch.compile(fn, fullgraph=True, dynamic=True), []

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args, **kwargs):
        if failed or not fused_on(x.device) or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        try:
            limit = torch._dynamo.config.patch(recompile_limit=128)
            with torch.compiler.set_stance("default"), limit:
                return compiled(x, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise  # not a compile failure: eager would need the memory too
        except Exception as error:  # Dynamo and Inductor raise many types
            failed.append(error)
            cause = error.__cause__ or error.__context__ or ""  # "Hard failure ..." hides why
            name = f"{fn.__module__}.{fn.__name__}"
            warnings.warn(f"{name} runs eagerly, compile failed: {error} ({cause})", stacklevel=2)
            return fn(x, *args, **kwargs)

    return run
