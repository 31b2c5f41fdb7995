"""The one intermediate representation every loader produces and every saver consumes.

A ModelState is our GPTModel's full (unsharded) parameters by parameter name, plus the
TransformerConfig that builds that model. Loaders translate a foreign layout into it, savers
translate it out; `check_model_state` compares the names and shapes with a GPTModel built on
the meta device from the config, so a loader's output is checked against the model itself and
not against a second list of names.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable

import torch

from megatron.core.checkpoint_files import TMP_SUFFIX, fsync_tree, publish_dir
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


class ConversionError(ValueError):
    """Input a conversion cannot use (another architecture, a missing, extra or misshapen
    tensor, an unknown format); the message names the tensor or file. convert.py prints it as
    one `error:` line and exits with status 2, before anything is written."""


@dataclasses.dataclass
class ModelState:
    state_dict: StateDict
    """Full parameters by our GPTModel's parameter names (see megatron/core/models/gpt)."""
    config: TransformerConfig
    """The architecture; training-only fields (fp8, recompute) are left at their defaults."""
    iteration: int = 0
    """The source's training iteration (0 for a HuggingFace model)."""


class SourceTensors:
    """A source's tensors, taken one by one as a loader maps them: a name not there is a
    missing tensor, and what is left at the end is an unexpected one (another architecture)."""

    def __init__(self, tensors: StateDict, source: str) -> None:
        self.tensors, self.source = dict(tensors), source

    def take(self, *names: str) -> Tensor:
        """The first of `names` present (alternative spellings of one tensor)."""
        for name in names:
            if name in self.tensors:
                return self.tensors.pop(name)
        raise ConversionError(f"{self.source}: tensor {names[0]} is missing")

    def check_all_used(self) -> None:
        if self.tensors:
            extra = sorted(self.tensors)
            raise ConversionError(
                f"{self.source}: unexpected tensor {extra[0]} ({len(extra)} the model config does "
                "not account for); the checkpoint is of another architecture or size"
            )


def model_config(config: TransformerConfig) -> TransformerConfig:
    """`config` without its training-only settings (FP8 recipe, activation recompute)."""
    return dataclasses.replace(config, fp8=None, recompute_granularity=None, recompute_num_layers=1)


def expected_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of our GPTModel for `config` (built on meta: no memory)."""
    try:
        with torch.device("meta"):
            model = GPTModel(model_config(config))
    except ValueError as error:
        raise ConversionError(f"the model config cannot build a GPTModel: {error}") from None
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def buffer_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of our GPTModel's persistent buffers for `config` (the routers' expert
    bias): state a ModelState may carry beside the parameters."""
    with torch.device("meta"):
        model = GPTModel(model_config(config))
    parameters = dict(model.named_parameters())
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in parameters}


def check_model_state(state: ModelState, *, source: str) -> None:
    """Exactly our GPTModel's parameters, with its shapes, and optionally its persistent
    buffers; else ConversionError naming the first offending tensor and `source`."""
    expected = expected_shapes(state.config)
    missing = sorted(set(expected) - set(state.state_dict))
    if missing:
        raise ConversionError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing)")
    buffers = {n: s for n, s in buffer_shapes(state.config).items() if n in state.state_dict}
    expected = {**expected, **buffers}
    unexpected = sorted(set(state.state_dict) - set(expected))
    if unexpected:
        raise ConversionError(
            f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} the model does not "
            "have)"
        )
    for name, shape in expected.items():
        tensor = state.state_dict[name]
        if tuple(tensor.shape) != shape:
            raise ConversionError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model config implies "
                f"{shape}"
            )
        if not tensor.is_floating_point():
            raise ConversionError(f"{source}: {name} has dtype {tensor.dtype}, not a float type")


def check_new_output_dir(path: str) -> None:
    """A converter writes a new directory: refuse one that exists and is not empty (it would
    be replaced whole), or a file."""
    if os.path.isfile(path):
        raise ConversionError(f"--save-dir {path} is a file; pass a directory path")
    if os.path.isdir(path) and os.listdir(path):
        raise ConversionError(
            f"--save-dir {path} exists and is not empty; pass a new or empty directory"
        )


def write_dir_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills `path.tmp`; it is fsynced and renamed to `path` only when complete,
    so an interrupted conversion never leaves a half-written `path`."""
    final = os.path.normpath(path)
    tmp = final + TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    fsync_tree(tmp)
    if os.path.isdir(final) and not os.listdir(final):
        os.rmdir(final)  # an empty target (checked by check_new_output_dir) is replaced
    publish_dir(tmp, final)
