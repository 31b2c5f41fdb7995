"""Issue 40, acceptance 2 (bytes): under --sequence-parallel a per-tensor FP8 recipe's
column-parallel input is all-gathered as FP8 bytes, so the tensor-parallel counters
(`tensor_parallel_bytes`) show that gather at half of bf16's bytes; the amax agreed over TP
first is counted apart, as one 4-byte all-reduce. The gathered input equals the dequantized
FP8 bytes of the whole input quantized at once (the bytes TP = 1 quantizes). Block recipes
gather in high precision (their wgrad operand needs the input's columns)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.fp8 import Fp8Config, quantize
from megatron.core.tensor_parallel import ColumnParallelLinear, TensorParallel
from megatron.core.tensor_parallel.fp8 import Fp8ColumnParallelLinear, gather_fp8_sequence
from megatron.core.tensor_parallel.mappings import (
    reset_tensor_parallel_bytes,
    scatter_to_sequence_parallel_region,
    tensor_parallel_bytes,
)
from tests.unit_tests.dist_utils import run_distributed

B, S, D, OUT = 2, 8, 64, 64
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _gather_bytes(rank: int, world_size: int) -> dict:
    tp = TensorParallel(dist.group.WORLD, sequence_parallel=True)
    torch.manual_seed(0)
    x = torch.randn(B, S, D, dtype=torch.bfloat16)
    shard = scatter_to_sequence_parallel_region(x, tp.group)
    found = {}
    bf16 = ColumnParallelLinear(D, OUT, bias=False, tensor_parallel=tp, dtype=torch.bfloat16)
    for name, layer in [("bf16", bf16)] + [(recipe, _fp8_layer(recipe, tp)) for recipe in RECIPES]:
        reset_tensor_parallel_bytes()
        layer(shard.detach().requires_grad_())
        found[name] = tensor_parallel_bytes()
    layer = _fp8_layer("tensorwise", tp)
    found["gathered"] = gather_fp8_sequence(shard, tp.group, layer._quantize_input_shard)
    found["whole"] = _bytes(x)
    found["amax"] = x.abs().max()
    return found


def _bytes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowwise bytes, scale_inv) of `t` quantized at once, tensorwise (an input, E4M3)."""
    qt = quantize(t, recipe="tensorwise", fp8_dtype=torch.float8_e4m3fn, role="input")
    operand = qt.gemm_operand("rowwise")
    return operand.data.view(torch.uint8).clone(), operand.scale_inv.clone()


def _fp8_layer(recipe: str, tp: TensorParallel) -> Fp8ColumnParallelLinear:
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    return Fp8ColumnParallelLinear(
        D, OUT, bias=False, tensor_parallel=tp, fp8_config=config, dtype=torch.bfloat16
    )


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_distributed(_gather_bytes, 2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_sequence_parallel_gather_bytes(per_rank, recipe) -> None:
    full_bf16 = B * S * D * 2
    bf16 = {"all_reduce": 0, "all_gather": full_bf16, "reduce_scatter": 0}
    for found in per_rank:
        assert found["bf16"] == bf16
        if recipe in ("delayed", "tensorwise"):
            fp8 = {"all_reduce": 4, "all_gather": full_bf16 // 2, "reduce_scatter": 0}
            assert found[recipe] == fp8
        else:
            assert found[recipe] == bf16


def test_fp8_gathered_input_quantizes_to_the_whole_inputs_bytes(per_rank) -> None:
    """The gathered FP8 bytes, dequantized with the agreed amax kept in one element, quantize
    again to exactly the bytes and scale of the whole (TP = 1) input."""
    for found in per_rank:
        gathered = found["gathered"]
        assert gathered.dtype == torch.bfloat16 and gathered.shape == (B, S, D)
        data, scale_inv = _bytes(gathered)
        whole_data, whole_scale_inv = found["whole"]
        assert torch.equal(scale_inv, whole_scale_inv)
        assert torch.equal(data, whole_data)
        assert gathered.abs().max() == found["amax"]
