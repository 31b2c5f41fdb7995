"""The one place a transformer Linear is built: plain torch.nn.Linear or FP8 Linear.

Model code calls `build_linear` and never looks at FP8 settings itself (docs/STYLE.md rule 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from megatron.core.fp8 import Fp8Linear
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from megatron.core.tensor_parallel.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig


def build_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    config: TransformerConfig,
    layer_number: int,
    parallel: Literal["column", "row"] | None = None,
    tensor_parallel: TensorParallel | None = None,
    output_blocks: Sequence[int] | None = None,
) -> nn.Module:
    """Return the Linear y = x W^T + b for transformer layer `layer_number` (1-based).

    FP8 only when `config.fp8` is set and that config keeps this layer in FP8 (the first/last
    layers may stay high precision); otherwise a plain nn.Linear in `config.params_dtype`.

    With `tensor_parallel`, `parallel` says how the weight splits over its group: "column"
    (output rows; `output_blocks` lists fused outputs such as [q, k, v] or [gate, up], each
    split so every rank holds matching pieces) or "row" (input columns, output summed).
    Without it, `parallel` and `output_blocks` are ignored: the full Linear of TP = 1.
    """
    if layer_number < 1 or layer_number > config.num_layers:
        raise ValueError(
            f"build_linear: layer_number {layer_number} is outside 1..{config.num_layers}; "
            "layer numbers are 1-based as in Megatron-LM"
        )
    fp8_config = config.fp8
    if tensor_parallel is not None and parallel is not None:
        return _tensor_parallel_linear(
            in_features,
            out_features,
            bias=bias,
            config=config,
            layer_number=layer_number,
            parallel=parallel,
            tensor_parallel=tensor_parallel,
            output_blocks=output_blocks,
        )
    if fp8_config is None or not fp8_config.layer_uses_fp8(layer_number, config.num_layers):
        return nn.Linear(in_features, out_features, bias=bias, dtype=config.params_dtype)
    return Fp8Linear(
        in_features, out_features, bias=bias, fp8_config=fp8_config, dtype=config.params_dtype
    )


def _tensor_parallel_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    config: TransformerConfig,
    layer_number: int,
    parallel: Literal["column", "row"],
    tensor_parallel: TensorParallel,
    output_blocks: Sequence[int] | None,
) -> nn.Module:
    fp8_config = config.fp8
    if fp8_config is not None and fp8_config.layer_uses_fp8(layer_number, config.num_layers):
        # FP8 across TP: Fp8Linear shards (megatron.core.tensor_parallel.fp8).
        fp8 = dict(bias=bias, tensor_parallel=tensor_parallel, fp8_config=fp8_config)
        if parallel == "column":
            return Fp8ColumnParallelLinear(
                in_features,
                out_features,
                output_blocks=output_blocks,
                **fp8,
                dtype=config.params_dtype,
            )
        if parallel == "row":
            return Fp8RowParallelLinear(in_features, out_features, **fp8, dtype=config.params_dtype)
    if parallel == "column":
        return ColumnParallelLinear(
            in_features,
            out_features,
            bias=bias,
            tensor_parallel=tensor_parallel,
            output_blocks=output_blocks,
            dtype=config.params_dtype,
        )
    if parallel == "row":
        return RowParallelLinear(
            in_features,
            out_features,
            bias=bias,
            tensor_parallel=tensor_parallel,
            dtype=config.params_dtype,
        )
    raise ValueError(f"parallel={parallel!r}; use 'column' or 'row'")


def linear_of_activation(
    linear: nn.Module,
    hidden: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """linear(activation(hidden)), where the caller's activation keeps `hidden` for its own
    backward. An FP8 Linear whose config sets `wgrad_input_from_activation` then keeps no FP8
    copy of the activation's output for its wgrad: it recomputes it from `hidden`."""
    x = activation(hidden)
    if isinstance(linear, Fp8Linear) and linear.fp8_config.wgrad_input_from_activation:
        return linear(x, activation_input=hidden, activation=activation)
    return linear(x)
