"""The MoE layer that replaces a layer's MLP: router, token dispatch to the routed experts
(over the expert-parallel group passed in), and the shared experts added to their output."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.moe.config_checks import check_moe_config
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.metrics import MoEMetrics
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExperts
from megatron.core.transformer.moe.token_dispatcher import (
    allgather_dispatch_combine,
    alltoall_dispatch_combine,
)
from megatron.core.transformer.recompute import recompute_or_run, recomputes
from megatron.core.transformer.transformer_config import TransformerConfig

DISPATCHERS = {"alltoall": alltoall_dispatch_combine, "allgather": allgather_dispatch_combine}


class MoELayer(nn.Module):
    """x [B, S, D] -> sum over the top-k experts of p * expert(x), plus shared_experts(x).

    This rank holds experts [ep_rank * L, (ep_rank + 1) * L) of num_moe_experts, with
    L = num_moe_experts / expert_model_parallel_size; `expert_parallel_group` must have
    expert_model_parallel_size ranks (None when it is 1).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        layer_number: int,
        expert_parallel_group: dist.ProcessGroup | None = None,
        metrics: MoEMetrics | None = None,
    ) -> None:
        super().__init__()
        check_moe_config(config)
        ep_size = 1 if expert_parallel_group is None else dist.get_world_size(expert_parallel_group)
        if ep_size != config.expert_model_parallel_size:
            raise ValueError(
                f"MoELayer: the expert-parallel group has {ep_size} ranks but "
                f"--expert-model-parallel-size is {config.expert_model_parallel_size}; pass the "
                "group of that size"
            )
        self.expert_parallel_group = expert_parallel_group
        self.num_local_experts = config.num_moe_experts // ep_size
        ep_rank = 0 if expert_parallel_group is None else dist.get_rank(expert_parallel_group)
        self.local_expert_offset = ep_rank * self.num_local_experts
        self.dispatch_combine = DISPATCHERS[config.moe_token_dispatcher_type]
        # Dropless top-k: every token goes to exactly top-k experts (a static count of routed
        # rows, which a compiled graph holds without a break).
        dropless = config.moe_expert_capacity_factor is None
        self.routed_per_token = config.moe_router_topk if dropless else None
        self.router = TopKRouter(config, layer_number=layer_number, metrics=metrics)
        self.experts = GroupedExperts(
            config,
            num_local_experts=self.num_local_experts,
            layer_number=layer_number,
            first_expert=self.local_expert_offset,
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExperts(config, layer_number=layer_number)
        self.recompute_shared = recomputes(config, "shared_experts")

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(x_BSD)
        hidden = x_BSD.reshape(-1, x_BSD.shape[-1])
        routed = self.dispatch_combine(
            hidden,
            probs,
            routing_map,
            experts=self.experts,
            group=self.expert_parallel_group,
            per_token=self.routed_per_token,
        )
        output = routed.view_as(x_BSD)
        if self.shared_experts is not None:
            output = output + recompute_or_run(self.recompute_shared, self.shared_experts, x_BSD)
        return output


def local_expert_rows(model: nn.Module) -> dict[str, slice]:
    """For each routed-expert parameter of `model`, by qualified name: the rows of the full
    [num_moe_experts, ...] tensor this rank holds. Initialization draws the full tensor and
    keeps these rows, so a weight has the same value at every expert-parallel size."""
    rows = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MoELayer):
            first = module.local_expert_offset
            held = slice(first, first + module.num_local_experts)
            prefix = f"{module_name}.experts." if module_name else "experts."
            for param_name, _ in module.experts.named_parameters():
                rows[prefix + param_name] = held
    return rows
