"""The routed experts of one rank: all fc1 weights in ONE stacked parameter
[num_local_experts, fc1_width, hidden] and all fc2 weights in another
[num_local_experts, hidden, moe_ffn_hidden_size], run through one grouped GEMM function.

`grouped_gemm` is the high-precision grouped GEMM: every expert matmul of forward and backward
goes through it. Under an FP8 recipe (a layer that `Fp8Config.layer_uses_fp8`) the stacked
weights are `megatron.core.transformer.moe.fp8_experts.Fp8StackedLinear` instead, whose
`grouped_fp8_gemm` runs every expert GEMM of forward and backward in FP8, each expert
quantized as one Linear weight (FP8_NUMERICS.md, "Experts").

`segments` (expert parallelism): the row counts of each local expert per source rank, from the
dispatcher. FP8 quantizes each segment on its own, so results do not depend on the EP size.
With one segment per expert the counts may stay on the device: bf16 on CUDA
(torch._grouped_mm) and the FP8 grouped function (tensorwise, blockwise; any device) read them
there, so a compiled MoE layer has no host sync and no graph break."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.transformer.mlp import gelu, swiglu
from megatron.core.transformer.moe import grouped_operands as operands
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from megatron.core.transformer.transformer_config import TransformerConfig


def _grouped_mm_runs(tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm covers tokens [N, in] @ weight [E, out, in]^T
    (`grouped_operands.bf16_grouped_mm_applies`); elsewhere the loop of mm."""
    return operands.bf16_grouped_mm_applies(tokens, weight, weight.shape[1:])


def grouped_gemm(
    tokens: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor
) -> torch.Tensor:
    """y[rows of expert e] = tokens[rows of expert e] @ weight[e]^T.

    tokens [N, in] sorted by expert, tokens_per_expert[e] rows each (summing to N; a list, or
    an integer tensor on the tokens' device, which torch._grouped_mm reads without a host
    sync); weight [E, out, in]. Returns [N, out] in the tokens' dtype.
    """
    if _grouped_mm_runs(tokens, weight):
        counts = torch.as_tensor(tokens_per_expert, device=tokens.device)
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(tokens, weight.transpose(1, 2), offs=offsets)
    if isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = tokens_per_expert.tolist()
    pieces = tokens.split(tokens_per_expert, dim=0)
    outputs = [piece @ weight[expert].t() for expert, piece in enumerate(pieces)]
    if not outputs:
        return tokens.new_zeros(0, weight.shape[1])
    return torch.cat(outputs, dim=0)


class StackedLinear(nn.Module):
    """The stacked weight [num_local_experts, out, in] of one Linear per local expert.

    A module of its own so that the parameter is named `<...>.linear_fc1.weight` /
    `.linear_fc2.weight` like the dense MLP's (init rules, FP8 selection, checkpoints)."""

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))

    def forward(
        self,
        tokens: torch.Tensor,
        tokens_per_expert: list[int] | torch.Tensor,
        segments: list[list[int]] | None = None,
    ) -> torch.Tensor:
        return grouped_gemm(tokens, self.weight, tokens_per_expert)


def _stacked_linear(
    config: TransformerConfig,
    num_experts: int,
    in_features: int,
    out_features: int,
    *,
    layer_number: int | None,
    first_expert: int,
) -> nn.Module:
    """The FP8 stacked Linear where the recipe covers this layer, else the high-precision one
    (first_expert: the global index of local expert 0, naming delayed-scaling state)."""
    fp8 = config.fp8
    dtype = config.params_dtype
    if fp8 is not None and (
        layer_number is None or fp8.layer_uses_fp8(layer_number, config.num_layers)
    ):
        return Fp8StackedLinear(
            num_experts,
            in_features,
            out_features,
            fp8_config=fp8,
            dtype=dtype,
            first_expert=first_expert,
        )
    return StackedLinear(num_experts, in_features, out_features, dtype=dtype)


class GroupedExperts(nn.Module):
    """fc2(act(fc1(x))) per local expert, act SwiGLU or GeLU as the dense MLP; no biases."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        num_local_experts: int,
        layer_number: int | None = None,
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.swiglu = config.swiglu
        ffn = config.moe_ffn_hidden_size
        fc1_width = ffn * (2 if config.swiglu else 1)
        stacked = dict(layer_number=layer_number, first_expert=first_expert)
        self.linear_fc1 = _stacked_linear(
            config, num_local_experts, config.hidden_size, fc1_width, **stacked
        )
        self.linear_fc2 = _stacked_linear(
            config, num_local_experts, ffn, config.hidden_size, **stacked
        )

    def forward(
        self,
        tokens: torch.Tensor,
        tokens_per_expert: list[int] | torch.Tensor,
        segments: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """tokens [N, hidden] sorted by local expert -> [N, hidden]; segments: each local
        expert's row counts per source rank (None: one segment per expert).
        tokens_per_expert may stay on the device (no host sync: a compiled layer keeps one
        graph) where both GEMMs read it there (torch._grouped_mm's, or the FP8 grouped
        function's); else it is read once here."""
        if isinstance(tokens_per_expert, torch.Tensor) and not self._device_counts_suffice(tokens):
            tokens_per_expert = tokens_per_expert.tolist()
        activation = swiglu if self.swiglu else gelu
        hidden = activation(self.linear_fc1(tokens, tokens_per_expert, segments))
        return self.linear_fc2(hidden, tokens_per_expert, segments)

    def _device_counts_suffice(self, tokens: torch.Tensor) -> bool:
        def takes(linear: nn.Module) -> bool:
            if isinstance(linear, Fp8StackedLinear):
                return linear.takes_device_counts(tokens)
            return type(linear) is StackedLinear and _grouped_mm_runs(tokens, linear.weight)

        return takes(self.linear_fc1) and takes(self.linear_fc2)
