"""fully_shard_model with a tensor-parallel mesh dimension (issue 40): a block of our TP layers
under --sequence-parallel (a norm on sequence shards, column- then row-parallel Linear),
ZeRO-3 over the DP dimension of a (dp_outer, dp_shard, tp) mesh, trained with a plain torch
optimizer through fully_shard_optimizer, follows the one-process full model step for step;
a tp_dim over modules without TP layers is refused, and so are sharded checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.distributed.data_parallel_mesh import (
    DP_SHARD_DIM,
    TP_DIM,
    build_data_parallel_mesh,
)
from megatron.core.distributed.fsdp.fully_shard import fully_shard_model, fully_shard_optimizer
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    mark_replicated_sequence_parallel_,
    scatter_to_sequence_parallel_region,
    tensor_parallel_shards,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from tests.unit_tests.dist_utils import run_distributed

BATCH, SEQ, HIDDEN, FFN, STEPS, LR = 4, 8, 8, 16, 4, 0.5


class Block(nn.Module):
    def __init__(self, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, bias=True, tensor_parallel=tp)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, bias=True, tensor_parallel=tp)

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(self.norm(x_shard))))
        return gather_from_sequence_parallel_region(y, self.tp.group, grad_is_partial=False)


def _full_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "norm.weight": (HIDDEN,),
        "norm.bias": (HIDDEN,),
        "fc1.weight": (FFN, HIDDEN),
        "fc1.bias": (FFN,),
        "fc2.weight": (HIDDEN, FFN),
        "fc2.bias": (HIDDEN,),
    }
    return {name: torch.randn(shape, generator=generator) * 0.3 for name, shape in shapes.items()}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    return x, torch.tanh(x.flip(-1))


def _reference_losses() -> list[float]:
    params = {k: v.clone().requires_grad_() for k, v in _full_params().items()}
    losses = []
    for step in range(STEPS):
        x, target = _batch(step)
        h = F.layer_norm(x, (HIDDEN,), params["norm.weight"], params["norm.bias"])
        h = F.gelu(F.linear(h, params["fc1.weight"], params["fc1.bias"]))
        loss = F.mse_loss(F.linear(h, params["fc2.weight"], params["fc2.bias"]), target)
        loss.backward()
        with torch.no_grad():
            for value in params.values():
                value -= LR * value.grad
                value.grad = None
        losses.append(loss.item())
    return losses


def _tp_fsdp_losses(rank: int, world_size: int) -> list[float]:
    mesh = build_data_parallel_mesh(
        world_size=world_size,
        num_distributed_optimizer_instances=1,
        device_type="cpu",
        tensor_parallel_size=2,
    )
    tp = TensorParallel(mesh.get_group(TP_DIM), sequence_parallel=True)
    block = Block(tp)
    owners = tensor_parallel_shards(block)
    with torch.no_grad():
        for name, param in block.named_parameters():
            full = _full_params()[name]
            owner = owners.get(name)
            param.copy_(full if owner is None else owner.shard_of_full(name.split(".")[-1], full))
    mark_replicated_sequence_parallel_(block, skip_prefixes=())
    model = fully_shard_model(block, mesh, dp_shard_dim=DP_SHARD_DIM, tp_dim=TP_DIM)
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    dp_group, dp_rank = mesh.get_group(DP_SHARD_DIM), mesh.get_local_rank(DP_SHARD_DIM)
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    losses = []
    for step in range(STEPS):
        x, target = _batch(step)
        x_shard = scatter_to_sequence_parallel_region(x[rows], tp.group)
        loss = F.mse_loss(model(x_shard), target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / 2)
    # Sharded checkpoints hold each TP shard's full (TP = 1) tensor.
    shapes = model.sharded_state_dict()["param_shapes"]
    for name, owner in owners.items():
        assert tuple(shapes[name].tolist()) == owner.full_shape(name.split(".")[-1]), name
    return losses


def test_fully_shard_model_over_tp_mesh_follows_one_process() -> None:
    reference = _reference_losses()
    assert reference[-1] < 0.8 * reference[0]  # it learns
    for losses in run_distributed(_tp_fsdp_losses, 4):
        assert losses == pytest.approx(reference, abs=1e-6)


def _refused(rank: int, world_size: int) -> str:
    mesh = build_data_parallel_mesh(
        world_size=world_size,
        num_distributed_optimizer_instances=1,
        device_type="cpu",
        tensor_parallel_size=2,
    )
    with pytest.raises(ValueError) as info:
        fully_shard_model(nn.Linear(4, 4), mesh, dp_shard_dim=DP_SHARD_DIM, tp_dim=TP_DIM)
    return str(info.value)


def test_tp_dim_without_tensor_parallel_layers_is_refused() -> None:
    for message in run_distributed(_refused, 2):
        assert "tp_dim 'tp' has size 2; build the module from megatron.core.tensor_parallel" in (
            message
        )
