"""Expert parallelism on gloo ranks: each rank holds num_experts / EP experts and its own
tokens; outputs and grads equal the single-process layer holding every expert (EP 1) within
1e-6 in fp32, for the alltoall and allgather dispatchers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models.moe.moe_helpers import EXPERTS, fill_parameters, moe_config

PARAM_SEED = 11


def _config(ep_size: int, dispatcher: str):
    return moe_config(
        swiglu=True,
        moe_shared_expert_intermediate_size=12,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=ep_size,
        moe_token_dispatcher_type=dispatcher,
    )


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(100 + rank))
    target = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(200 + rank))
    return x, target


def _full_layer(dispatcher: str) -> MoELayer:
    layer = MoELayer(_config(1, dispatcher), layer_number=1)
    fill_parameters(layer, seed=PARAM_SEED)
    return layer


def _forward_backward(layer: MoELayer, rank: int) -> dict:
    x, target = _inputs(rank)
    x.requires_grad_()
    out = layer(x)
    (out * target).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads}


def _ep_worker(rank: int, world_size: int, ep_size: int, dispatcher: str) -> dict:
    my_group = None
    for start in range(0, world_size, ep_size):
        group = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            my_group = group
    full = _full_layer(dispatcher)
    layer = MoELayer(_config(ep_size, dispatcher), layer_number=1, expert_parallel_group=my_group)
    first, count = layer.local_expert_offset, layer.num_local_experts
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            source = full_params[name]
            param.copy_(source[first : first + count] if name.startswith("experts.") else source)
    result = _forward_backward(layer, rank)
    model = GPTModel(_config(ep_size, dispatcher), seed=5, expert_parallel_group=my_group)
    result["init"] = {n: p.detach() for n, p in model.named_parameters() if ".experts." in n}
    return result


@pytest.mark.parametrize(
    ("world_size", "ep_size", "dispatcher"),
    [(2, 2, "alltoall"), (2, 2, "allgather"), (4, 4, "alltoall"), (4, 2, "allgather")],
)
def test_expert_parallel_equals_ep1(world_size, ep_size, dispatcher):
    results = run_distributed(_ep_worker, world_size, ep_size, dispatcher)
    full = _full_layer(dispatcher)
    references = []
    for rank in range(world_size):
        full.zero_grad()
        references.append(_forward_backward(full, rank))
    local = EXPERTS // ep_size
    full_model = dict(GPTModel(_config(1, dispatcher), seed=5).named_parameters())
    for rank, result in enumerate(results):
        reference = references[rank]
        torch.testing.assert_close(result["out"], reference["out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(result["x_grad"], reference["x_grad"], rtol=0, atol=1e-6)
        group_start = rank - rank % ep_size
        first = (rank % ep_size) * local
        for name, grad in result["grads"].items():
            if name.startswith("experts."):
                # An expert's grad gathers the tokens of every rank of its EP group.
                peers = range(group_start, group_start + ep_size)
                expected = sum(references[peer]["grads"][name] for peer in peers)
                expected = expected[first : first + local]
            else:
                expected = reference["grads"][name]
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6, msg=name)
        # Initialization keeps each rank's rows of the EP-1 weights, bit for bit.
        assert len(result["init"]) == 2
        for name, value in result["init"].items():
            assert torch.equal(value, full_model[name][first : first + local]), name
