"""FP8 across tensor parallelism (issue 40): `Fp8Linear` shards split as Megatron-LM splits
them, and the sequence-parallel all-gather in FP8. docs/FP8_NUMERICS.md, "FP8 across tensor
parallelism", states the rules; this module applies them through the FP8 package's public face.

- `Fp8ColumnParallelLinear` / `Fp8RowParallelLinear` are `Fp8Linear`s of the local shard
  ([out/tp, in] and [out, in/tp]), so the Megatron-FSDP engine keeps their weights as FP8
  parameters like any other. Scales that cover the whole logical weight (tensorwise, delayed)
  come from its amax MAX-reduced over the TP group (the engine's amax reduction, given the
  group), so each shard's bytes are the slice of TP = 1's; block (128x128) and MX (1x32) cells
  must not straddle a TP cut (refused at parse time: `training/flags/tensor_parallel.py`).
- Tensorwise activations split over TP (a row-parallel input, a column-parallel output's
  gradient) take the whole tensor's scale: AMAX_ROWS rows carrying the amax MAX-reduced over
  TP are appended to the GEMM operand (zero rows on the other side; their outputs dropped).
- Under sequence parallelism a per-tensor recipe's column-parallel input is all-gathered as
  FP8 bytes: the local sequence shard is quantized with the scale of the whole gathered tensor
  (its amax MAX-reduced over TP first; delayed: the history's scale, agreed over TP), the bytes
  are gathered, and the GEMM re-derives its operand from them bitwise (dequantized, with one
  element of largest magnitude set back to the agreed amax, so that quantizing again finds the
  same amax, scale and bytes; the delayed history records that amax). Block recipes gather in
  high precision: their wgrad operand has Bx1 cells along the tokens, which the FP8 bytes of
  1xB row cells cannot reproduce bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.core.fp8 import Fp8Config, Fp8Linear, fp8_dtype_for_role, quantize
from megatron.core.fp8.autocast import in_recompute
from megatron.core.tensor_parallel.layers import (
    ColumnSplit,
    RowSplit,
    TensorParallel,
    column_blocks,
    divide,
    mark_sequence_parallel_,
)
from megatron.core.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    _reduce_scatter,
    copy_to_tensor_parallel_region,
    count_collective,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class _Fp8SequenceGather(torch.autograd.Function):
    """All-gather of sequence shards [B, S/tp, D] moved as FP8 bytes; the output is their
    exact dequantized values with one largest element set back to the agreed amax (module
    docstring). Backward: the reduce-scatter of the (partial) input gradient."""

    @staticmethod
    def forward(ctx, x, group, quantize_shard):
        ctx.group = group
        amax = agreed_amax(x, group)
        data, scale_inv = quantize_shard(x.detach(), amax)
        raw = data.contiguous().view(torch.uint8)  # gloo moves no float8 dtype
        pieces = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, raw, group=group)
        full = torch.cat(pieces, dim=SEQUENCE_DIM)
        count_collective("all_gather", full)
        return _values_with_amax(full.view(data.dtype), scale_inv, amax, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None, None


def _values_with_amax(
    q: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q * scale_inv in `dtype`, within +-amax, one element of largest |q| set to +-amax."""
    values = (q.to(torch.float32) * scale_inv.to(torch.float32)).to(dtype)
    if torch.isfinite(amax) and amax > 0:
        bound = amax.to(dtype)
        values = torch.minimum(torch.maximum(values, -bound), bound)
        flat = values.view(-1)
        index = q.to(torch.float32).abs().view(-1).argmax()
        flat[index] = torch.copysign(bound, flat[index])
    return values


AMAX_ROWS = 16
"""Rows appended to a GEMM operand to carry an agreed amax (16: FP8 GEMM dims stay multiples of
16 for torch._scaled_mm)."""


def agreed_amax(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """max |t| over every rank of `group` (fp32, 0-d), counted as an all-reduce."""
    amax = t.detach().abs().amax().float().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    count_collective("all_reduce", amax)
    return amax.reshape(())


def _amax_rows(like: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """AMAX_ROWS zero rows shaped like `like`'s rows, the first element `amax` (None: zeros)."""
    rows = like.new_zeros(AMAX_ROWS, like.shape[-1])
    if amax is not None:
        rows[0, 0] = amax.to(like.dtype)
    return rows


class _AppendAmaxRows(torch.autograd.Function):
    """[x2d; rows carrying the amax of x over the TP group]: a per-tensor quantization of the
    result uses the whole (unsplit) tensor's scale. Backward drops the rows' gradient."""

    @staticmethod
    def forward(ctx, x2d, group):
        return torch.cat([x2d, _amax_rows(x2d, agreed_amax(x2d, group))])

    @staticmethod
    def backward(ctx, grad):
        return grad[:-AMAX_ROWS], None


class _DropAmaxRows(torch.autograd.Function):
    """y2d without its last AMAX_ROWS rows; backward appends rows carrying the gradient's amax
    over the TP group (a per-tensor quantization of the gradient then uses the whole output's
    scale; the matching input rows are zero, so wgrad gains nothing from them)."""

    @staticmethod
    def forward(ctx, y2d, group):
        ctx.group = group
        return y2d[:-AMAX_ROWS]

    @staticmethod
    def backward(ctx, grad):
        return torch.cat([grad, _amax_rows(grad, agreed_amax(grad, ctx.group))]), None


def gather_fp8_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, quantize_shard: Callable
) -> torch.Tensor:
    """[B, S, D] from this rank's [B, S/tp, D], moved as FP8 bytes quantized by
    `quantize_shard(shard, agreed_amax) -> (fp8 data, scale_inv)`."""
    if dist.get_world_size(group) == 1:
        return x
    return _Fp8SequenceGather.apply(x, group, quantize_shard)


class Fp8ColumnParallelLinear(Fp8Linear, ColumnSplit):
    """`ColumnParallelLinear` in FP8: an Fp8Linear of this rank's output rows [out/tp, in]
    (each block of `output_blocks` split over TP). Its input is replicated (gradient
    all-reduced) or, under sequence parallelism, gathered from sequence shards (in FP8 for a
    per-tensor recipe)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tensor_parallel: TensorParallel,
        fp8_config: Fp8Config,
        output_blocks: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        blocks = column_blocks(out_features, output_blocks, tensor_parallel.size)
        local_out = out_features // tensor_parallel.size
        super().__init__(in_features, local_out, bias=bias, fp8_config=fp8_config, dtype=dtype)
        self.tp, self.output_blocks = tensor_parallel, blocks
        self.bias_in_gemm = False  # added after the GEMM, whose rows may carry an amax
        self.full_out_features = out_features

    def forward(self, x: torch.Tensor, **activation) -> torch.Tensor:
        enabled, config, _, _ = self._current_settings()
        if not self.tp.sequence_parallel:
            x = copy_to_tensor_parallel_region(x, self.tp.group)
        elif enabled and config.spec.per_tensor:
            x = gather_fp8_sequence(x, self.tp.group, self._quantize_input_shard)
        else:
            x = gather_from_sequence_parallel_region(x, self.tp.group)
        if enabled and config.spec.accepts_global_amax:
            # The output (and so its gradient) is split over TP: the gradient's scale comes
            # from its amax over TP, carried by rows appended to the input (zero) and output.
            x2d = x.reshape(-1, x.shape[-1])
            y2d = super().forward(torch.cat([x2d, _amax_rows(x2d, None)]))
            y = _DropAmaxRows.apply(y2d, self.tp.group).reshape(*x.shape[:-1], -1)
        else:
            y = super().forward(x, **activation)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _quantize_input_shard(
        self, shard: torch.Tensor, amax: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's input shard in FP8 with the whole input's scale: tensorwise from the
        agreed amax, delayed from the input history (its scale agrees over the amax group)."""
        _, config, _, _ = self._current_settings()
        how = dict(recipe=config.recipe, role="input")
        how["fp8_dtype"] = fp8_dtype_for_role(config.fp8_format, "input")
        if config.spec.delayed:
            self.delayed_scaling.move_to(shard.device)
            meta = self.delayed_scaling.metas["input"]
            # A recompute quantizes with the first forward's scale, as the GEMM's plan does.
            recompute = in_recompute() and meta.forward_scale is not None
            how["scale"] = meta.forward_scale if recompute else meta.scale
        else:
            how.update(amax=amax, power_2_scale=config.quantize_power_2_scale)
        qt = quantize(shard, **how)
        operand = qt.gemm_operand("rowwise")
        return operand.data.reshape(shard.shape), operand.scale_inv


class Fp8RowParallelLinear(Fp8Linear, RowSplit):
    """`RowParallelLinear` in FP8: an Fp8Linear of this rank's input columns [out, in/tp]; the
    partial outputs are summed over TP (or reduce-scattered to sequence shards, in high
    precision) and the replicated bias is added after the sum."""

    bias_in_gemm = False  # added once, after the sum over TP

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tensor_parallel: TensorParallel,
        fp8_config: Fp8Config,
        dtype: torch.dtype | None = None,
    ) -> None:
        local_in = divide(in_features, tensor_parallel.size, "row-parallel input width")
        super().__init__(local_in, out_features, bias=bias, fp8_config=fp8_config, dtype=dtype)
        self.tp, self.full_in_features = tensor_parallel, in_features
        if self.bias is not None and self.tp.sequence_parallel:
            mark_sequence_parallel_(self.bias)

    def forward(self, x: torch.Tensor, **activation) -> torch.Tensor:
        enabled, config, _, _ = self._current_settings()
        if enabled and config.spec.accepts_global_amax:
            # The input is split over TP: its scale comes from its amax over TP (appended rows).
            # The rows' outputs are dropped, so their gradient is zero. wgrad quantizes the
            # input kept here rather than recomputing it from `activation`'s input.
            x2d = _AppendAmaxRows.apply(x.reshape(-1, x.shape[-1]), self.tp.group)
            y = super().forward(x2d)[:-AMAX_ROWS].reshape(*x.shape[:-1], -1)
        else:
            y = super().forward(x, **activation)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)
