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
  gradient) take the whole tensor's scale: the layer's quantizer (`Fp8Linear.fp8_quantizer`,
  which its GEMMs' plan calls for that role) has the backend quantize with the amax
  MAX-reduced over the TP group (one 4-byte all-reduce, counted). At TP = 1 there is none.
- Under sequence parallelism the column-parallel input is all-gathered as FP8 bytes and the
  GEMM reads them as its quantized input (the same quantizer hands them over): each rank
  quantizes its sequence shard as the whole input quantizes (tensorwise: with the amax
  MAX-reduced over TP first; delayed: the history's scale, agreed over TP, and the agreed amax
  recorded), and the bytes (and block scale grids) are gathered in rank order. Only this
  rank's shard of the bytes wgrad reads is kept, gathered again in backward
  (`_regathered_wgrad_input`, the layer's `_Plan.wgrad_input`), as Megatron-LM keeps a bf16
  input's shard: per-tensor recipes gather the rowwise bytes both times (wgrad reads their
  transpose). Block recipes' rowwise 1x128 / 1x32 cells are row-local, but wgrad reads Bx1
  cells along the tokens, which are a rank's own only when its token count per sequence is a
  multiple of B (128 blockwise, 32 mxfp8): then the columnwise copy is quantized locally,
  kept, and gathered in backward; otherwise the input is gathered in high precision (logged
  once per recipe and shard length). Each FP8 gather moves half of a bf16 gather's bytes
  (counted; scale grids, 1/32 of that, travel uncounted).
- Under torch.compile, a column-parallel Linear whose forward makes QuantizedTensors of its
  activations (the FP8 sequence gather of delayed, blockwise and mxfp8) runs eagerly between
  the layer's compiled pieces (`_forward_eagerly`); the others trace like any Fp8Linear, the
  agreed amax's all-reduce included. Tensorwise's gather moves the rowwise operand that the
  backend's quantizer makes (`Fp8Operand`: plain tensors), so it traces too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.fp8 import (
    Fp8Config,
    Fp8Linear,
    Fp8Operand,
    QuantizedTensor,
    fp8_dtype_for_role,
    quantize,
)
from megatron.core.fp8.autocast import in_recompute
from megatron.core.fp8.quantization import backend_for
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
    _gather,
    _reduce_scatter,
    copy_to_tensor_parallel_region,
    count_collective,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

logger = logging.getLogger(__name__)


class _SequenceGatherEdge(torch.autograd.Function):
    """The gradient's path of a sequence gather whose values travel as FP8 bytes: forward
    returns `values`, or a stride-0 stand-in of the gathered shape (the GEMM reads the gathered
    QuantizedTensor instead); backward reduce-scatters the (partial) input gradient."""

    @staticmethod
    def forward(ctx, x, group, shape, values):
        ctx.group = group
        if values is not None:
            return values.reshape(shape)
        return torch.empty_strided(shape, (0,) * len(shape), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None, None, None


def _gather_tokens(
    t: torch.Tensor, batch: int, group: dist.ProcessGroup, *, count: bool
) -> torch.Tensor:
    """[batch * n, C] pieces of [batch, n, C] (token-major rows) gathered along n in rank order:
    [batch * world * n, C]. One-byte dtypes travel as uint8 (gloo moves no float8)."""
    raw = t.contiguous()
    raw = raw.view(torch.uint8) if raw.element_size() == 1 else raw
    full = _gather(raw.reshape(batch, -1, raw.shape[-1]), 1, group, count=count)
    return full.reshape(-1, raw.shape[-1]).view(t.dtype)


def _gathered(
    shard: QuantizedTensor, batch: int, group: dist.ProcessGroup | None, directions: tuple
) -> QuantizedTensor:
    """The QuantizedTensor of the gathered [batch * S, D] input from this rank's shard's, in
    `directions` only: bytes (counted) and block scale grids gathered along the tokens; a
    per-tensor scale is already the same on every rank. group None: the shard's own bytes in
    `directions` (nothing gathered)."""
    per_tensor = shard.spec.per_tensor
    parts = {}
    for direction in ("rowwise", "columnwise"):
        data = scale_inv = None
        if direction in directions:
            data = getattr(shard, f"{direction}_data")
            scale_inv = getattr(shard, f"{direction}_scale_inv")
        if data is not None and group is not None:  # the bytes counted, the scale grids not
            data = _gather_tokens(data, batch, group, count=True)
            if not per_tensor:
                scale_inv = _gather_tokens(scale_inv, batch, group, count=False)
        parts[f"{direction}_data"], parts[f"{direction}_scale_inv"] = data, scale_inv
    rows = shard.shape[0] * (dist.get_world_size(group) if group is not None else 1)
    meta = dict(recipe=shard.recipe, fp8_dtype=shard.fp8_dtype, role=shard.role)
    return QuantizedTensor(shape=(rows, shard.shape[1]), dtype=shard.dtype, **meta, **parts)


def _wgrad_direction(shard: QuantizedTensor) -> str:
    """The bytes wgrad's operand is made from: the columnwise copy where the recipe quantizes
    one (block recipes), else the rowwise bytes (their transpose)."""
    return "columnwise" if shard.columnwise_data is not None else "rowwise"


@dataclass
class SequenceGathered:
    """A sequence-parallel input moved as FP8 bytes: the gathered operand that fprop reads
    (dropped when the forward is done: the plan that backward keeps holds this), and this
    rank's shard's bytes that backward gathers again for wgrad (only the shard is kept, as
    Megatron-LM and TransformerEngine keep it)."""

    gathered: QuantizedTensor | Fp8Operand | None
    shard: QuantizedTensor | Fp8Operand
    batch: int
    """Sequences in the micro-batch (the gathers' token-major layout)."""


def gather_fp8_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, quantize_shard: Callable, *, values: bool = False
) -> tuple[torch.Tensor, SequenceGathered | None]:
    """(x's [B, S, D] stand-in, the gathered input [B * S, D] and the shard's wgrad bytes) from
    this rank's [B, S/tp, D], moved as FP8 bytes quantized by `quantize_shard(shard [B * S/tp,
    D])`: QuantizedTensors, or (tensorwise) rowwise Fp8Operands, plain tensors that a compiled
    graph holds; `values`: the stand-in holds the gathered values (dequantized: --log-fp8-stats
    reads them). (x, None) on one rank."""
    world = dist.get_world_size(group)
    if world == 1:
        return x, None
    shard = quantize_shard(x.detach().reshape(-1, x.shape[-1]))
    if isinstance(shard, Fp8Operand):  # per tensor: the scale is agreed, the bytes travel
        gathered = shard._replace(data=_gather_tokens(shard.data, x.shape[0], group, count=True))
        kept = shard
        full = gathered.dequantize().to(x.dtype) if values else None
    else:
        gathered = _gathered(shard, x.shape[0], group, ("rowwise",))
        kept = _gathered(shard, x.shape[0], None, (_wgrad_direction(shard),))
        full = gathered.dequantize(x.dtype) if values else None
    shape = (x.shape[0], x.shape[1] * world, *x.shape[2:])
    return _SequenceGatherEdge.apply(x, group, shape, full), SequenceGathered(
        gathered, kept, x.shape[0]
    )


def _regathered_wgrad_input(ops, shard, compute_dtype, *, batch, group):
    """`_Plan.wgrad_input` under sequence parallelism: wgrad's operand of the gathered input,
    from this rank's shard's bytes gathered again now (as the forward gathered them)."""
    if isinstance(shard, Fp8Operand):  # wgrad reads the gathered rowwise bytes' transpose
        data = _gather_tokens(shard.data, batch, group, count=True)
        return shard._replace(data=data.t().contiguous())
    gathered = _gathered(shard, batch, group, (_wgrad_direction(shard),))
    return ops.weight_operand(gathered, "columnwise", compute_dtype=compute_dtype)


def _split_operands(
    ops, t2d, role, rowwise, transposed, compute_dtype, *, config, group, split, given
):
    """`Fp8Linear.fp8_quantizer` of a tensor-parallel Linear (its plan's `quantizer`): the
    operands of the `given` (gathered) input; under tensorwise, of a `split` role's tensor
    quantized by the backend with the amax MAX-reduced over `group` (plain tensors: a
    compiled graph holds them); None (the backend's quantization) otherwise."""
    if role == "input" and given is not None:  # the gathered input; wgrad's is made later
        row = given.gathered
        if rowwise and not isinstance(row, Fp8Operand):
            row = ops.weight_operand(row, "rowwise", compute_dtype=compute_dtype)
        return (row if rowwise else None), (given.shard if transposed else None)
    if role not in split or not config.spec.accepts_global_amax:
        return None
    return _agreed_amax_operands(ops, t2d, config, role, group, rowwise, transposed)


def _agreed_amax_operands(ops, t2d, config, role, group, rowwise, transposed):
    """Tensorwise over TP: the backend's (rowwise, transposed) operands of this rank's piece
    of a split tensor, quantized with the amax MAX-reduced over `group` (the whole tensor's
    scale): plain tensors, which a compiled graph holds."""
    return ops.quantize_operands(
        t2d,
        recipe=config.recipe,
        fp8_dtype=fp8_dtype_for_role(config.fp8_format, role),
        role=role,
        rowwise=rowwise,
        transposed=transposed,
        power_2_scale=config.spec.resolve_power_2_scale(config.quantize_power_2_scale),
        amax=agreed_amax(t2d, group),
    )


def _set_quantizer(layer: Fp8Linear, config: Fp8Config, split: tuple[str, ...], given=None):
    """Point `layer`'s next GEMMs (its plan keeps the functions for backward) at
    `_split_operands` with these settings, and with an input `given` gathered over the sequence
    its wgrad at `_regathered_wgrad_input`; at TP = 1 nothing."""
    if layer.tp.size == 1:
        return
    group = layer.tp.group
    layer.fp8_quantizer = functools.partial(
        _split_operands, config=config, group=group, split=split, given=given
    )
    if given is not None:
        regather = functools.partial(_regathered_wgrad_input, group=group, batch=given.batch)
        layer.fp8_wgrad_input = regather


@torch._dynamo.disable
def _forward_eagerly(layer: Fp8Linear, x: torch.Tensor, activation: dict) -> torch.Tensor:
    """A tensor-parallel FP8 Linear's forward run eagerly from a compiled layer (one graph
    break each side), when it makes QuantizedTensors of its activations: they are not a
    traceable tensor subclass (`fp8.compile.forward_outside_the_graph` says why). The
    layer's norms, attention and elementwise code around it stay compiled."""
    return layer._parallel_forward(x, **activation)


def agreed_amax(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """max |t| over every rank of `group` (fp32, 0-d), counted as an all-reduce."""
    amax = t.detach().abs().amax().float().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    count_collective("all_reduce", amax)
    return amax.reshape(())


class Fp8ColumnParallelLinear(Fp8Linear, ColumnSplit):
    """`ColumnParallelLinear` in FP8: an Fp8Linear of this rank's output rows [out/tp, in]
    (each block of `output_blocks` split over TP). Its input is replicated (gradient
    all-reduced) or, under sequence parallelism, gathered from sequence shards as FP8 bytes
    (module docstring: block recipes need shards of whole columnwise cells, else bf16)."""

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
        self.full_out_features = out_features

    def forward(self, x: torch.Tensor, **activation) -> torch.Tensor:
        if torch.compiler.is_compiling() and self._builds_quantized_tensors(x):
            return _forward_eagerly(self, x, activation)
        return self._parallel_forward(x, **activation)

    def _builds_quantized_tensors(self, x: torch.Tensor) -> bool:
        """Whether this forward makes QuantizedTensors of its activations (the FP8 sequence
        gather of delayed, blockwise and mxfp8; tensorwise's gathers operands), which dynamo
        cannot trace."""
        enabled, config, _, _ = self._current_settings()
        if not enabled or self.tp.size == 1 or not self.tp.sequence_parallel:
            return False
        spec = config.spec
        return not spec.accepts_global_amax and _gathers_fp8(spec, x.shape[SEQUENCE_DIM])

    def _parallel_forward(self, x: torch.Tensor, **activation) -> torch.Tensor:
        enabled, config, _, _ = self._current_settings()
        given = None
        if not self.tp.sequence_parallel:
            x = copy_to_tensor_parallel_region(x, self.tp.group)
        elif enabled and _gathers_fp8(config.spec, x.shape[SEQUENCE_DIM]):
            how = dict(values=self.fp8_stats_on)
            x, given = gather_fp8_sequence(x, self.tp.group, self._quantize_input_shard, **how)
        else:
            x = gather_from_sequence_parallel_region(x, self.tp.group)
        _set_quantizer(self, config, ("grad",), given)  # the output, so its gradient, is split
        y = super().forward(x, **activation)
        # Its plan keeps them for backward; the module keeps no input, the plan no gathered one.
        self.fp8_quantizer = self.fp8_wgrad_input = None
        if given is not None:
            given.gathered = None
        return y

    def _quantize_input_shard(self, shard: torch.Tensor) -> QuantizedTensor | Fp8Operand:
        """This rank's input shard [tokens, in] in FP8 as the whole input quantizes: rowwise,
        and columnwise where wgrad needs a copy (block recipes). Tensorwise: the rowwise
        operand with the agreed amax's scale, from the backend; delayed: the input history's
        scale (agreed over the amax group), the agreed amax recorded in it, as the GEMM's own
        quantization records."""
        _, config, _, _ = self._current_settings()
        spec = config.spec
        if spec.accepts_global_amax:
            ops = backend_for(shard)
            return _agreed_amax_operands(ops, shard, config, "input", self.tp.group, True, False)[0]
        how = dict(recipe=config.recipe, role="input", columnwise=spec.columnwise_copy("input"))
        how["fp8_dtype"] = fp8_dtype_for_role(config.fp8_format, "input")
        if spec.delayed:
            self.delayed_scaling.move_to(shard.device)
            meta = self.delayed_scaling.metas["input"]
            # A recompute quantizes with the first forward's scale and records nothing.
            if in_recompute() and meta.forward_scale is not None:
                return quantize(shard, **how, scale=meta.forward_scale)
            meta.record(agreed_amax(shard, self.tp.group))
            return quantize(shard, **how, scale=meta.scale)
        return quantize(shard, **how, power_2_scale=config.quantize_power_2_scale)


_FALLBACKS_LOGGED: set[tuple[str, int]] = set()


def _gathers_fp8(spec, shard_tokens: int) -> bool:
    """Whether the sequence-parallel gather moves FP8 bytes: per tensor always; block recipes
    when the shard's tokens are whole columnwise cells (wgrad's Bx1 cells along the tokens stay
    each rank's own), else the gather is bf16, logged once per (recipe, shard length)."""
    if spec.per_tensor or shard_tokens % spec.block == 0:
        return True
    if (spec.name, shard_tokens) not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add((spec.name, shard_tokens))
        logger.warning(
            "sequence-parallel %s: %d tokens per rank is not a multiple of the %d-token "
            "columnwise cell; the column-parallel input is all-gathered in high precision "
            "(a sequence length of a multiple of %d x the TP size gathers FP8 bytes)",
            spec.name,
            shard_tokens,
            spec.block,
            spec.block,
        )
    return False


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
        _set_quantizer(self, self._current_settings()[1], ("input",))  # the input is split
        y = super().forward(x, **activation)
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)
