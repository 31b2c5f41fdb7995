"""A training step with FP8 parameters makes no tensor from a Python number in the FP8 and FSDP
code. On CUDA each such tensor is a host-to-device copy that synchronizes the stream, and
the host then waits for the GPU to drain. `history[..., 0] = 0.0` in roll_amax_history did this
once per FP8 weight and step under delayed scaling (32 synchronizations per step on Model A),
and `torch.tensor(fp8_max)` in the E8M0 scale of every mxfp8 block quantization. Counted on CPU
as aten.lift_fresh, as the difference between a 2- and a 4-iteration run: none per step."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain


class _Lifts(TorchDispatchMode):
    """Where the FP8 and FSDP code turns a Python number into a tensor (not while importing)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            stack = traceback.extract_stack()
            # A project module being imported runs its top level once, not per step.
            if not any(f.name == "<module>" and "/megatron/" in f.filename for f in stack):
                for frame in reversed(stack):
                    if "megatron/core/fp8" in frame.filename or "fsdp" in frame.filename:
                        self.sites[f"{frame.filename}:{frame.lineno}"] += 1
                        break
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_a_training_step_makes_no_tensor_from_a_python_number(recipe: str):
    sites = []
    for iters in (2, 4):
        flags = [*TINY_GPT, *NO_DROPOUT, "--bf16", "--use-megatron-fsdp", "--fp8-param-gather"]
        flags += ["--swiglu", "--fp8-recipe", recipe, "--train-iters", str(iters)]
        lifts = _Lifts()
        with lifts:
            run_pretrain(flags)
        sites.append(lifts.sites)
    assert sites[1] == sites[0], sites
