"""Issue 40, acceptance 2 (bytes): under --sequence-parallel the column-parallel input is
all-gathered as FP8 bytes and handed to the GEMM as its quantized input, so the
tensor-parallel counters (`tensor_parallel_bytes`) show each FP8 gather at half of bf16's
bytes. Only this rank's shard of the bytes wgrad reads is kept for backward and gathered again
there, as Megatron-LM keeps the shard of a bf16 input: per-tensor recipes gather the rowwise
bytes in forward and again in backward (wgrad reads their transpose), block recipes the rowwise
bytes in forward and the columnwise copy (wgrad's Bx1 cells along the tokens) in backward, when
each rank's tokens are whole cells (128 blockwise, 32 mxfp8); otherwise they gather in bf16 and
keep the FP8 copy of the whole input. The amax agreed over TP first is counted apart, as one
4-byte all-reduce. Scale grids travel with the bytes, uncounted (4 bytes per 128 elements
blockwise, 1 per 32 mxfp8: 1/32 of the FP8 bytes). The GEMM operands of the gathered input
(rowwise for fprop, transposed for wgrad), and of the split output gradient (its tensorwise
scale from the amax MAX-reduced over TP), are bitwise TP = 1's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import megatron.core.tensor_parallel.fp8 as fp8_tp
from megatron.core.fp8 import Fp8Config, Fp8Linear, QuantizedTensor, reference_ops
from megatron.core.tensor_parallel import ColumnParallelLinear, TensorParallel
from megatron.core.tensor_parallel.fp8 import Fp8ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    reset_tensor_parallel_bytes,
    scatter_to_sequence_parallel_region,
    tensor_parallel_bytes,
)
from tests.unit_tests.dist_utils import run_distributed

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
UNALIGNED = dict(batch=2, seq=8, hidden=64, out=64)
"""4 tokens per rank: block recipes gather in bf16."""
ALIGNED = dict(batch=1, seq=256, hidden=128, out=256)
"""128 tokens per rank: whole blockwise (128) and mxfp8 (32) columnwise cells; 128 output
columns per rank, whole 128x128 weight blocks."""


def _config(recipe: str) -> Fp8Config:
    return Fp8Config(recipe=recipe, fp8_format="hybrid")


def _operands(run) -> list[tuple]:
    """The (a, b) operands of every FP8 GEMM that `run()` calls: bytes and scale_inv."""
    gemm, found = reference_ops.gemm, []

    def spy(a, b, **kwargs):
        found.append(
            tuple((op.data.view(torch.uint8).clone(), op.scale_inv.clone()) for op in (a, b))
        )
        return gemm(a, b, **kwargs)

    setattr(reference_ops, "gemm", spy)  # noqa: B010
    try:
        run()
    finally:
        setattr(reference_ops, "gemm", gemm)  # noqa: B010
    return found


def _layer_case(recipe: str, tp: TensorParallel, *, batch, seq, hidden, out) -> dict:
    """TP = 1 Fp8Linear and its column-parallel twin on the same input and output gradient:
    the twin's forward bytes by collective kind, the GEMM operands of both, and the delayed
    input histories."""
    torch.manual_seed(0)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16)
    grad = torch.randn(batch, seq, out, dtype=torch.bfloat16)
    full = Fp8Linear(hidden, out, bias=False, fp8_config=_config(recipe), dtype=torch.bfloat16)
    twin = Fp8ColumnParallelLinear(
        hidden, out, bias=False, tensor_parallel=tp, fp8_config=_config(recipe),
        dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.no_grad():
        twin.weight.copy_(full.weight.chunk(tp.size)[tp.rank])
    shard = scatter_to_sequence_parallel_region(x, tp.group).detach().requires_grad_()
    found = {"full": _operands(lambda: full(x.clone().requires_grad_()).backward(grad))}

    def run_twin() -> None:
        reset_tensor_parallel_bytes()
        gathers = _spy_gathers()
        try:
            y = twin(shard)
        finally:
            setattr(fp8_tp, "_gather_tokens", gathers.original)  # noqa: B010
        found["bytes"] = tensor_parallel_bytes()
        found["kept"] = _kept_input_bytes(y)
        gc.collect()
        found["forward gathers alive"] = sum(ref() is not None for ref in gathers.refs)
        reset_tensor_parallel_bytes()
        y.backward(grad.chunk(tp.size, dim=-1)[tp.rank])
        found["backward bytes"] = tensor_parallel_bytes()

    found["twin"] = _operands(run_twin)
    if full.delayed_scaling is not None:
        histories = [m.delayed_scaling.metas["input"].amax_history for m in (full, twin)]
        found["histories"] = [h.clone() for h in histories]
    return found


class _Spy:
    def __init__(self) -> None:
        self.original, self.refs = fp8_tp._gather_tokens, []


def _spy_gathers() -> _Spy:
    """Weak references to every FP8 byte gather's output (`_gather_tokens`) until restored."""
    spy = _Spy()

    def gather(t, batch, group, *, count):
        out = spy.original(t, batch, group, count=count)
        spy.refs.append(weakref.ref(out))
        return out

    setattr(fp8_tp, "_gather_tokens", gather)  # noqa: B010
    return spy


def _kept_input_bytes(y: torch.Tensor) -> int:
    """Bytes of the input operand that the FP8 Linear behind `y` keeps for its wgrad."""
    node = y.grad_fn
    while not hasattr(node, "saved_input"):
        node = node.next_functions[0][0]
    kept = node.saved_input
    if isinstance(kept, QuantizedTensor):
        return sum(t.numel() for t in (kept.rowwise_data, kept.columnwise_data) if t is not None)
    return kept.data.numel() * kept.data.element_size()


def _cases(rank: int, world_size: int) -> dict:
    tp = TensorParallel(dist.group.WORLD, sequence_parallel=True)
    found = {}
    for name, shape in (("unaligned", UNALIGNED), ("aligned", ALIGNED)):
        torch.manual_seed(0)
        x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], dtype=torch.bfloat16)
        shard = scatter_to_sequence_parallel_region(x, tp.group)
        bf16 = ColumnParallelLinear(
            shape["hidden"], shape["out"], bias=False, tensor_parallel=tp, dtype=torch.bfloat16
        )
        reset_tensor_parallel_bytes()
        y = bf16(shard.detach().requires_grad_())
        found[name, "bf16"] = tensor_parallel_bytes()
        reset_tensor_parallel_bytes()
        y.backward(torch.ones_like(y))
        found[name, "bf16 backward"] = tensor_parallel_bytes()
        for recipe in RECIPES:
            found[name, recipe] = _layer_case(recipe, tp, **shape)
    found["stats"] = _input_stats(tp)
    return found


def _input_stats(tp: TensorParallel) -> dict:
    """--log-fp8-stats on a tensorwise layer whose input is gathered in FP8: the input's
    statistics are those of the gathered values (the whole input's amax)."""
    shape = ALIGNED
    torch.manual_seed(0)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], dtype=torch.bfloat16)
    layer = Fp8ColumnParallelLinear(
        shape["hidden"], shape["out"], bias=False, tensor_parallel=tp,
        fp8_config=_config("tensorwise"), dtype=torch.bfloat16,
    )  # fmt: skip
    seen = {}
    layer.fp8_stats_on = True
    layer.fp8_stats_sink = lambda module, role, vector, numel: seen.update({role: (vector, numel)})
    layer(scatter_to_sequence_parallel_region(x, tp.group))
    vector, numel = seen["input"]
    return {"amax": vector[0].item(), "numel": numel, "expected": x.abs().max().item()}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_distributed(_cases, 2)


def _half_bf16(shape: dict) -> int:
    return shape["batch"] * shape["seq"] * shape["hidden"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", ["unaligned", "aligned"])
def test_sequence_parallel_gather_bytes(per_rank, case, recipe) -> None:
    """Forward gathers the rowwise bytes; only the shard's wgrad bytes are kept, gathered again
    in backward (bf16's Linear keeps its shard too); the input gradient is reduce-scattered in
    the activations' dtype."""
    shape = UNALIGNED if case == "unaligned" else ALIGNED
    half = _half_bf16(shape)
    bf16 = {"all_reduce": 0, "all_gather": 2 * half, "reduce_scatter": 0}
    bf16_backward = {"all_reduce": 0, "all_gather": 2 * half, "reduce_scatter": 2 * half}
    amax = 4 if recipe in ("delayed", "tensorwise") else 0  # the agreed amax, one fp32
    fp8 = recipe in ("delayed", "tensorwise") or case == "aligned"
    if fp8:
        forward = {"all_reduce": amax, "all_gather": half, "reduce_scatter": 0}
        kept = half // 2  # this rank's half of the tokens, one byte each
    else:  # gathered in bf16; the Linear keeps its FP8 copy of the whole input
        forward, kept = bf16, half
    backward_amax = 4 if recipe == "tensorwise" else 0  # the split output gradient's
    backward = {
        "all_reduce": backward_amax,
        "all_gather": half if fp8 else 0,
        "reduce_scatter": 2 * half,
    }
    for found in per_rank:
        assert found[case, "bf16"] == bf16
        assert found[case, "bf16 backward"] == bf16_backward
        assert found[case, recipe]["bytes"] == forward
        assert found[case, recipe]["backward bytes"] == backward
        assert found[case, recipe]["kept"] == kept
        assert found[case, recipe]["forward gathers alive"] == 0  # nothing gathered is kept


def _piece(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s half of a TP = 1 operand's bytes or scale grid along `dim` (a 0-d
    per-tensor scale is the whole tensor's)."""
    return t if t.dim() < 2 else t.chunk(2, dim=dim)[rank]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", ["unaligned", "aligned"])
def test_gemm_operands_equal_tp1s(per_rank, case, recipe) -> None:
    """GEMMs in order fprop (x, w), dgrad (dy, w^T), wgrad (dy^T, x^T): the input's operands
    are TP = 1's; the output gradient's are its columns (aligned case: whole 128-wide cells)."""
    for rank, found in enumerate(per_rank):
        full, twin = found[case, recipe]["full"], found[case, recipe]["twin"]
        assert len(full) == len(twin) == 3
        pairs = [(twin[0][0], full[0][0]), (twin[2][1], full[2][1])]
        if case == "aligned":
            dy, dy_t = full[1][0], full[2][0]
            pairs.append((twin[1][0], tuple(_piece(t, 1, rank) for t in dy)))
            pairs.append((twin[2][0], tuple(_piece(t, 0, rank) for t in dy_t)))
        for index, (mine, expected) in enumerate(pairs):
            assert torch.equal(mine[0], expected[0]), (rank, index, "bytes")
            assert torch.equal(mine[1], expected[1]), (rank, index, "scale_inv")
        if recipe == "delayed":  # the twin recorded the whole input's amax
            tp1_history, twin_history = found[case, recipe]["histories"]
            assert tp1_history.amax() > 0 and torch.equal(twin_history, tp1_history)


def test_input_statistics_are_the_gathered_inputs(per_rank) -> None:
    for found in per_rank:
        stats = found["stats"]
        assert stats["numel"] == ALIGNED["batch"] * ALIGNED["seq"] * ALIGNED["hidden"]
        assert stats["amax"] == stats["expected"]
