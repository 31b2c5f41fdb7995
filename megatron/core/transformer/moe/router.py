"""The MoE router: a [experts, hidden] gating weight, then Megatron-LM's top-k routing with
its capacity, load-balancing losses, z-loss and aux-loss-free expert bias."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.moe import routing
from megatron.core.transformer.moe.metrics import (
    DROPPED_TOKEN_FRACTION,
    LOAD_BALANCING_LOSS,
    SEQ_LOAD_BALANCING_LOSS,
    Z_LOSS,
    MoEMetrics,
    attach_aux_loss,
)
from megatron.core.transformer.transformer_config import TransformerConfig

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _recomputing() -> bool:
    """True inside backward, i.e. when activation recompute re-runs this forward: the losses
    are attached again (the recomputed graph needs them) but not counted twice."""
    return torch._C._current_graph_task_id() != -1


# One forward's records: (metric name or TOKENS, value); kept until `_publish` decides.
TOKENS = "tokens"


class TopKRouter(nn.Module):
    """logits = x W^T in the router dtype; returns (probs [T, E], routing_map [T, E]).

    `expert_bias` (a persistent fp32 buffer, with --moe-router-enable-expert-bias) shifts the
    choice only; `local_tokens_per_expert` counts the tokens routed since the last
    `update_expert_bias`. The router stays in high precision: it is a plain Parameter, never
    built by build_linear.
    """

    def __init__(
        self, config: TransformerConfig, *, layer_number: int, metrics: MoEMetrics | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.metrics = metrics
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(
            torch.empty(config.num_moe_experts, config.hidden_size, dtype=config.params_dtype)
        )
        # Asked of the autograd engine by the compiled layer's eager pre-hook
        # (`before_compiled_forward`): inside a traced forward the question is a graph break.
        self._hooked_recompute: bool | None = None
        self._pending: list[tuple[str, torch.Tensor]] = []
        self.init_buffers(None)

    def init_buffers(self, device: torch.device | str | None) -> None:
        """(Re)create the expert-bias buffers at their initial zeros (after a meta-device
        build, `GPTModel.init_buffers`; a checkpoint load then overwrites the bias)."""
        enabled = self.config.moe_router_enable_expert_bias
        zeros = torch.zeros(self.config.num_moe_experts, device=device) if enabled else None
        self.register_buffer("expert_bias", zeros)
        counts = None if zeros is None else zeros.clone()
        self.register_buffer("local_tokens_per_expert", counts, persistent=False)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, x.dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = x_BSD.shape[0]
        logits = self.gating(x_BSD).flatten(0, -2)
        training = self.training and torch.is_grad_enabled()
        if training and self.config.moe_z_loss_coeff is not None:
            loss = routing.z_loss(logits, coeff=self.config.moe_z_loss_coeff)
            logits = attach_aux_loss(logits, loss, self.metrics)
            self._record(Z_LOSS, loss / self.config.moe_z_loss_coeff)
        probs, routing_map = self._route(logits, training=training)
        if training and self.config.moe_aux_loss_coeff > 0:
            probs = self._attach_load_balancing_loss(probs, logits, batch=batch)
        if training:
            self._pending.append((TOKENS, routing_map.sum(dim=0)))
            if self._hooked_recompute is None or not torch.compiler.is_compiling():
                self._publish(_recomputing() if self._hooked_recompute is None else None)
        return probs, routing_map

    def _route(self, logits: torch.Tensor, *, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        if config.moe_router_load_balancing_type == "sinkhorn":
            return self._sinkhorn_route(logits, training=training)
        probs, routing_map = routing.topk_routing(
            logits,
            topk=self.topk,
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        if config.moe_expert_capacity_factor is not None:
            chosen = routing_map
            probs, routing_map = routing.drop_over_capacity(
                probs,
                chosen,
                topk=self.topk,
                capacity_factor=config.moe_expert_capacity_factor,
                drop_policy=config.moe_token_drop_policy,
                pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            )
            if training:
                kept = (chosen & routing_map).sum()
                self._record(DROPPED_TOKEN_FRACTION, 1.0 - kept / chosen.sum())
        return probs, routing_map

    def _sinkhorn_route(
        self, logits: torch.Tensor, *, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron-LM's sinkhorn routing: in training the choice is the top-k of the
        Sinkhorn-balanced fp32 logits; the probs are sigmoid (k = 1) or softmax of the logits."""
        if self.topk == 1:
            activated = torch.sigmoid(logits)
        else:
            activated = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        with torch.no_grad():
            choice = routing.sinkhorn(logits.float()) if training else activated
            indices = choice.topk(self.topk, dim=1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return activated * routing_map, routing_map

    def _attach_load_balancing_loss(
        self, probs: torch.Tensor, logits: torch.Tensor, *, batch: int
    ) -> torch.Tensor:
        config = self.config
        kind = config.moe_router_load_balancing_type
        if kind not in ("aux_loss", "seq_aux_loss"):
            return probs
        aux_map, scores = routing.scores_for_aux_loss(
            logits, topk=self.topk, score_function=config.moe_router_score_function
        )
        coeff = config.moe_aux_loss_coeff
        if kind == "aux_loss":
            loss = routing.aux_loss(scores, aux_map, topk=self.topk, coeff=coeff)
            self._record(LOAD_BALANCING_LOSS, loss / coeff)
        else:
            loss = routing.seq_aux_loss(scores, aux_map, batch=batch, topk=self.topk, coeff=coeff)
            self._record(SEQ_LOAD_BALANCING_LOSS, loss / coeff)
        return attach_aux_loss(probs, loss, self.metrics)

    def _record(self, name: str, value: torch.Tensor) -> None:
        self._pending.append((name, value))

    def _publish(self, recompute: bool | None) -> None:
        """Count this forward's records (routed tokens into the expert-bias counts and the
        metrics; router losses into the metrics) unless it is a recompute, then forget them.
        Eager: at the end of the router's forward. Compiled: from the layer's eager post-hook
        (`after_compiled_forward`), so the traced forward is the same graph in the first
        forward and in the recompute (a recompute that traced fewer ops would save other
        tensors for backward than the checkpoint recorded). recompute None: the hook's."""
        pending = list(self._pending)
        self._pending.clear()  # the same list: a traced forward's guards see one object
        if recompute is None:
            recompute = bool(self._hooked_recompute)
        if recompute:
            return
        for name, value in pending:
            if name != TOKENS:
                if self.metrics is not None:
                    self.metrics.record(name, value, layer_number=self.layer_number)
                continue
            if self.local_tokens_per_expert is not None:
                with torch.no_grad():
                    self.local_tokens_per_expert += value
            if self.metrics is not None:
                self.metrics.record_tokens(value, layer_number=self.layer_number)

    def before_compiled_forward(self, device: torch.device | None = None) -> None:
        """`fp8.compile.prepare_for_compile`'s eager pre-hook of the compiled layer: whether
        the next forward is a recompute, asked here rather than in the graph. Records left
        over are a recompute's that checkpoint stopped early (once it had every saved tensor
        back, before the post-hook): dropped."""
        self._pending.clear()
        self._hooked_recompute = _recomputing()

    def after_compiled_forward(self) -> None:
        """The eager post-hook: count the forward's records (`_publish`); no delayed-scaling
        flush to queue."""
        self._publish(None)
        self._hooked_recompute = None

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing step (Megatron-LM, arXiv 2408.15664): sum the routed-token
        counts over `group` (the data-parallel ranks; None: this rank only), then
        bias += rate * sign(mean count - count), and restart the counts."""
        if self.expert_bias is None:
            return
        counts = self.local_tokens_per_expert
        if group is not None:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.config.moe_router_bias_update_rate
        counts.zero_()


def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """The expert-bias step of every router in `model`, after each optimizer step (Megatron-LM
    does it when finalizing the grads); `group`: the ranks whose token counts are summed."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.update_expert_bias(group)
