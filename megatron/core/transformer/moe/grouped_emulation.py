"""The CPU twins of the experts' FP8 grouped GEMMs (`grouped_fp8.py`): one emulated GEMM per
segment on the dequantized operands (`Fp8Operand.dequantize`), bitwise the per-segment path's
(`fp8_experts.grouped_fp8_gemm`: the same operand shapes, and the weight gradient summed into
each expert last segment first, as autograd sums the per-segment path's contributions)."""

from __future__ import annotations

from megatron.core.fp8.quantized_tensor import Fp8Operand
from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.transformer.moe import grouped_operands as operands


def cells(spec: RecipeSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """Block cells of the token operand and of the weight ((0, 0): per tensor)."""
    if spec.per_tensor:
        return (0, 0), (0, 0)
    return (1, spec.block), (spec.block, spec.block)


def emulated_mm(a, a_scale_inv, b, b_scale_inv, seg_sizes, seg_expert, recipe, out_dtype):
    """The CPU twin: per segment, dequantized A rows @ dequantized B[e]^T in fp32."""
    spec = recipe_spec(recipe)
    seg_sizes = seg_sizes.tolist()
    a_cell, b_cell = cells(spec)
    starts = operands.bounds(seg_sizes)
    out = a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
    for s, expert in enumerate(seg_expert):
        if seg_sizes[s] == 0:
            continue
        rows = slice(starts[s], starts[s + 1])
        row_scale = a_scale_inv[starts[s]] if spec.per_tensor else a_scale_inv[rows]
        a_values = Fp8Operand(a[rows], row_scale, recipe, *a_cell).dequantize()
        b_values = Fp8Operand(b[expert], b_scale_inv[expert], recipe, *b_cell).dequantize()
        out[rows] = (a_values @ b_values.t()).to(out_dtype)
    return out


def _segment_operand(data, scale_inv, s, seg_sizes, chunks, spec, recipe) -> Fp8Operand:
    """Segment s's transposed operand [*, rows] of the weight gradient (the per-segment path's
    `gemm_operand("columnwise")`): per tensor its rows of the rowwise bytes [M, *] and its
    scale; blockwise its columns of the padded transposed copy [*, P] and its cells
    (seg_sizes and chunks: host lists)."""
    if spec.per_tensor:
        start = sum(seg_sizes[:s])
        rows = data[start : start + seg_sizes[s]]
        return Fp8Operand(rows.t().contiguous(), scale_inv[s], recipe)
    start = chunks[s] * spec.block
    data_t = data[:, start : start + seg_sizes[s]].contiguous()
    cells = scale_inv[:, chunks[s] : chunks[s + 1]].contiguous()
    return Fp8Operand(data_t, cells, recipe, 1, spec.block)


def emulated_wgrad(dy, dy_scale_inv, x, x_scale_inv, seg_sizes, seg_expert, recipe, out):
    """Per segment: (dy_s^T dequantized) @ (x_s^T dequantized)^T in fp32, rounded to out's
    dtype, summed into its expert last segment first (the per-segment path's operand shapes and
    the order its backward sums them in)."""
    spec = recipe_spec(recipe)
    seg_sizes = seg_sizes.tolist()
    chunks = operands.chunk_bounds(seg_sizes, spec.block or 1)
    for s, expert in reversed(list(enumerate(seg_expert))):
        if seg_sizes[s] == 0:
            continue
        where = (s, seg_sizes, chunks, spec, recipe)
        dy_t = _segment_operand(dy, dy_scale_inv, *where).dequantize()
        x_t = _segment_operand(x, x_scale_inv, *where).dequantize()
        out[expert] += (dy_t @ x_t.t()).to(out.dtype)
    return out
