"""Megatron-FSDP's standalone API: a plain-PyTorch script written against `megatron_fsdp`
(and TransformerEngine's `quantized_model_init`) runs here with only its imports changed, and
gives the same losses at 1 and 2 gloo ranks, for fp32 and FP8 (mxfp8) parameters.

Only the import block below differs from the Megatron-FSDP version of the script:

    from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer
    from transformer_engine.pytorch import quantized_model_init
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard_model,
    fully_shard_optimizer,
    quantized_model_init,
)
from megatron.core.fp8 import Fp8Config, Fp8Linear, QuantizedTensor
from tests.unit_tests.dist_utils import run_distributed

HIDDEN, TOKENS, STEPS = 32, 128, 10


class Block(nn.Module):
    def __init__(self, fp8: Fp8Config | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        linear = (lambda i, o: Fp8Linear(i, o, fp8_config=fp8)) if fp8 else nn.Linear
        self.fc1 = linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, fp8: Fp8Config | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(fp8) for _ in range(2))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _script(rank: int, world_size: int, fp8: bool) -> dict:
    """The user's script: meta init (under quantized_model_init for FP8), fully_shard_model,
    fully_shard_optimizer(AdamW), an ordinary backward / step / zero_grad loop."""
    # mxfp8: activation and grad scales are per 32-element block of one rank's rows, so
    # they do not depend on how the batch is split (per-tensor activation scales would).
    recipe = Fp8Config(recipe="mxfp8") if fp8 else None
    with (
        torch.device("meta"),
        quantized_model_init(enabled=fp8, recipe="mxfp8", preserve_high_precision_init_val=True),
    ):
        model = Net(recipe)
    model = fully_shard_model(
        model,
        fsdp_unit_modules=[f"{__name__}.Block"],
        zero_dp_strategy=3,
        init_model_with_meta_device=True,
        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32),
    )
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        target = torch.sin(x.flip(-1))
        rows = slice(rank * TOKENS // world_size, (rank + 1) * TOKENS // world_size)
        loss = F.mse_loss(model(x[rows]), target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    fp8_weights = sum(isinstance(p, QuantizedTensor) for p in model.parameters())
    return {"losses": losses, "fp8_weights": fp8_weights, "state": len(optimizer.state)}


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_megatron_fsdp_script_same_losses_at_1_and_2_ranks(fp8: bool) -> None:
    one = run_distributed(_script, 1, fp8)[0]
    two = run_distributed(_script, 2, fp8)
    assert one["losses"][-1] < 0.7 * one["losses"][0]  # it learns
    assert one["fp8_weights"] == (4 if fp8 else 0)  # fc1, fc2 of both blocks stay FP8
    # One process: Adam state for every parameter piece (2 blocks x 6 + head 2).
    assert one["state"] == 14
    for rank_result in two:
        assert rank_result["fp8_weights"] == one["fp8_weights"]
        for step, (got, want) in enumerate(zip(rank_result["losses"], one["losses"])):
            assert got == pytest.approx(want, rel=1e-5, abs=0), step
