"""The optimizer interface the training loop drives, and its data-parallel (replicated) version.

Every optimizer here keeps fp32 main params, clips by the global grad norm, and skips the update
when that norm is NaN/Inf. Megatron-FSDP's sharded optimizer implements the same interface.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron.core.dist_checkpointing.flat_dtensor import ExpertPlacement
from megatron.core.dist_checkpointing.tp_placement import TensorParallelPlacement
from megatron.core.optimizer.clip_grads import clip_and_step, global_grad_norm
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.fused_adamw import FusedAdamW
from megatron.core.optimizer.offload import OffloadedAdamW, offload_count
from megatron.core.optimizer.precision import state_precision


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports to the training loop's log line."""

    update_successful: bool
    grad_norm: float
    num_zeros_in_grad: int | None = None


class MegatronOptimizer(ABC):
    """What the training loop needs: zero_grad, step, LR/WD groups, and a state to checkpoint."""

    param_groups: list[dict]
    """Each group has 'lr' and 'weight_decay' (set by the LR scheduler every step), and
    'max_lr'/'min_lr' where the group has its own schedule (--decoupled-lr)."""

    loss_scale: float = 1.0
    """The factor the loss was multiplied by before backward (--fp16): step() divides the
    grads by it before the norm, the clip and the update."""

    count_zeros_in_grad: bool = False
    """--log-num-zeros-in-grad: step() counts the zero entries of the (reduced) grads."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def step(self) -> StepResult: ...

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


def is_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (all 1-D params) are not decayed, as in Megatron-LM."""
    return param.ndim < 2 or name.endswith(".bias")


def is_embedding_or_output_parameter(name: str) -> bool:
    """The input embedding table and the output layer weight: what --decoupled-lr trains at
    its own rate (Megatron-LM's is_embedding_or_output_parameter)."""
    return name.endswith("embedding.word_embeddings.weight") or name.endswith("output_layer.weight")


def is_mup_scaled_parameter(name: str, param: torch.Tensor, config: OptimizerConfig) -> bool:
    """Under muP (width mult != 1): the hidden matrix-like params, whose lr (Adam also eps) is
    scaled; vector-like params (ndim <= 1), embeddings and the output layer keep the base
    values (Megatron-LM's get_mup_config_overrides). SGD scales the vector-like ones instead,
    except decoupled-lr embedding/output weights, which keep --decoupled-lr."""
    if config.mup_width_mult == 1.0:
        return False
    embedding_class = ".embedding." in f".{name}" or name.endswith("output_layer.weight")
    vector_like = embedding_class or param.ndim <= 1
    if config.optimizer == "sgd":
        decoupled = config.decoupled_lr is not None and is_embedding_or_output_parameter(name)
        return vector_like and not decoupled
    return not vector_like


def mup_group_overrides(config: OptimizerConfig) -> dict[str, float]:
    """max_lr, min_lr (and for Adam eps) of a muP-scaled group: Adam's hidden matrices at
    1 / width mult, SGD's vector-like params at width mult times the base."""
    mult = config.mup_width_mult if config.optimizer == "sgd" else 1.0 / config.mup_width_mult
    overrides = {"max_lr": config.lr * mult, "min_lr": config.min_lr * mult}
    if config.optimizer == "adam":
        overrides["eps"] = config.adam_eps * mult
    return overrides


def build_torch_optimizer(
    named_main_params: Iterable[tuple[str, torch.Tensor]], *, config: OptimizerConfig
) -> torch.optim.Optimizer:
    """AdamW or SGD over main params, split into a decayed and a non-decayed group, with
    --decoupled-lr each of those again into the embedding/output weights and the rest, and
    under muP into the width-scaled params (own max_lr/min_lr/eps) and the rest."""
    decoupled = config.decoupled_lr is not None
    split: dict[tuple[bool, bool, bool], list[torch.Tensor]] = {}
    for name, param in named_main_params:
        own_lr = decoupled and is_embedding_or_output_parameter(name)
        scaled = is_mup_scaled_parameter(name, param, config)
        key = (own_lr, scaled, is_no_weight_decay(name, param))
        split.setdefault(key, []).append(param)
    groups = []
    # Plain groups first: the scheduler reports group 0's lr as the run's learning rate.
    for own_lr, scaled, no_decay in itertools.product((False, True), repeat=3):
        params = split.get((own_lr, scaled, no_decay), [])
        if not params:
            continue
        group = {
            "params": params,
            "weight_decay": 0.0 if no_decay else config.weight_decay,
            "wd_mult": 0.0 if no_decay else 1.0,
        }
        if own_lr:
            group["max_lr"] = config.decoupled_lr
            group["min_lr"] = (
                config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
            )
        if scaled:
            group.update(mup_group_overrides(config))
        groups.append(group)
    check_optimizer_config(config)
    if config.optimizer == "adam":
        options = dict(
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **adam_implementation([p for group in groups for p in group["params"]]),
        )
        if config.use_precision_aware_optimizer:
            options.update(
                exp_avg_dtype=config.exp_avg_dtype,
                exp_avg_sq_dtype=config.exp_avg_sq_dtype,
                moment_scaling=config.moment_scaling,
            )
        if config.optimizer_cpu_offload:
            return OffloadedAdamW(
                groups, offload_fraction=config.optimizer_offload_fraction, **options
            )
        return FusedAdamW(groups, **options)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, foreach=False)


def check_optimizer_config(config: OptimizerConfig) -> None:
    """Refuse optimizer-state settings that cannot work; the ValueError names the flags and the
    fix (argument checks turn it into the parse-time exit 2)."""
    low_precision = (config.exp_avg_dtype, config.exp_avg_sq_dtype) != ("fp32", "fp32")
    if low_precision and not config.use_precision_aware_optimizer:
        raise ValueError(
            "--exp-avg-dtype/--exp-avg-sq-dtype other than fp32 need "
            "--use-precision-aware-optimizer (as in Megatron-LM)"
        )
    if config.optimizer_cpu_offload and not config.use_precision_aware_optimizer:
        raise ValueError(
            "--optimizer-cpu-offload needs --use-precision-aware-optimizer (as in Megatron-LM)"
        )
    if (low_precision or config.optimizer_cpu_offload) and config.optimizer != "adam":
        raise ValueError(
            "--use-precision-aware-optimizer moment dtypes and --optimizer-cpu-offload apply to "
            "--optimizer adam only"
        )
    if config.use_precision_aware_optimizer:
        state_precision(
            exp_avg_dtype=config.exp_avg_dtype,
            exp_avg_sq_dtype=config.exp_avg_sq_dtype,
            scaling=config.moment_scaling,
        )
    if config.optimizer_cpu_offload:
        offload_count([], config.optimizer_offload_fraction)


DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float64: "fp64",
}


def state_bytes_by_dtype(optimizer) -> dict[str, int]:
    """Bytes of an optimizer's state tensors (moments, their scales, momentum; not the step
    count) by dtype, e.g. {"bf16": n}; state held on the CPU (offload) as e.g. "fp32 cpu"."""
    totals: dict[str, int] = {}
    if optimizer is None:
        return totals
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            name = DTYPE_NAMES.get(value.dtype, str(value.dtype).removeprefix("torch."))
            if value.device.type == "cpu" and torch.cuda.is_available():
                name += " cpu"
            totals[name] = totals.get(name, 0) + value.numel() * value.element_size()
    return totals


def adam_implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation flags: the fused kernel on CUDA, the per-tensor loop elsewhere.

    The per-tensor loop makes ~6 passes over the params and moments per step, which on an H200
    was 23 ms of a 166 ms step for 1.2 B fp32 params; the fused kernel makes one. On CPU the
    loop stays: it is what the CPU golden values were recorded with, and CPU runs are small.
    """
    on_cuda = bool(params) and all(p.is_cuda and p.dtype == torch.float32 for p in params)
    return {"fused": True} if on_cuda else {"foreach": False}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops reach the DTensor), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def unscale_grads_(grads: list[torch.Tensor], loss_scale: float) -> None:
    """Divide grads by the loss scale (a no-op at 1); an overflow stays Inf for the norm."""
    if loss_scale != 1.0:
        for grad in grads:
            grad.mul_(1.0 / loss_scale)


@torch.no_grad()
def count_zeros(grads: list[torch.Tensor], group=None) -> int:
    """Zero entries over the grads (summed over `group`'s ranks when the grads are shards)."""
    total = sum(int((grad == 0).sum()) for grad in grads)
    if group is not None:
        import torch.distributed as dist

        device = grads[0].device if grads else torch.device("cpu")
        count = torch.tensor([float(total)], device=device)
        dist.all_reduce(count, group=group)
        total = int(count.item())
    return total


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Optimizer over replicated params (no sharding): fp32 main copies of bf16 model params.

    With fp32 model params the main params are the model params themselves. Grads must already
    be averaged across data-parallel ranks (DDP does that), so the norm is computed locally.
    With expert parallelism (`expert_parallel_group`, `expert_param_names`) the routed-expert
    params differ across that group: the norm and zero count sum the expert pieces of every
    EP rank and the replicated pieces of EP rank 0.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        config: OptimizerConfig,
        grad_group=None,
        expert_parallel_group=None,
        expert_param_names: Iterable[str] = (),
        norm_param_names: set[str] | None = None,
        tensor_parallel_placement: TensorParallelPlacement | None = None,
    ) -> None:
        self.config = config
        # Under TP (with `grad_group` the TP group): where this rank's TP shards lie in the
        # full tensors (sharded checkpoints).
        self.tensor_parallel_placement = tensor_parallel_placement
        # With DTensor (FSDP2) params each rank holds disjoint shards: norms and counts are
        # summed over this group. With `norm_param_names` (tensor parallelism: the TP shards,
        # and the replicated params on TP rank 0 only; expert parallelism: the expert params,
        # and the replicated ones on EP rank 0 only) only those enter this rank's piece.
        self.grad_group = grad_group
        self.expert_parallel_group = expert_parallel_group
        expert_param_names = tuple(expert_param_names)
        # Where this rank's experts lie in the full expert tensors (sharded checkpoints).
        self.expert_placement = ExpertPlacement.of_group(expert_param_names, expert_parallel_group)
        if expert_parallel_group is not None:
            if grad_group is not None or norm_param_names is not None:
                raise ValueError("expert parallelism with sharded or TP params is not built")
            self.grad_group = expert_parallel_group
            if torch.distributed.get_rank(expert_parallel_group) != 0:
                norm_param_names = set(expert_param_names)  # replicated params: EP rank 0's
        self.norm_param_names = norm_param_names
        self.model_params: list[torch.Tensor] = []
        named_main = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            main = param if param.dtype == torch.float32 else param.detach().float().clone()
            self.model_params.append(param)
            named_main.append((name, main))
        self.main_params = [main for _, main in named_main]
        self.main_param_names = [name for name, _ in named_main]
        self.optimizer = build_torch_optimizer(named_main, config=config)

    @property
    def param_groups(self) -> list[dict]:
        # A property, not an attribute: torch's load_state_dict replaces the group list, and
        # the LR scheduler must set the lr the optimizer actually reads.
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for param in self.model_params:
            param.grad = None
        for main in self.main_params:
            main.grad = None

    def _copy_model_grads_to_main(self) -> list[torch.Tensor]:
        grads = []
        for param, main in zip(self.model_params, self.main_params):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            if main is not param:
                main.grad = grad.float()
            grads.append(main.grad if main.grad is not None else grad)
        return grads

    def step(self) -> StepResult:
        grads = [_local(grad) for grad in self._copy_model_grads_to_main()]
        unscale_grads_(grads, self.loss_scale)
        counted = self._norm_piece(grads)
        grad_norm = global_grad_norm(counted, group=self.grad_group)
        zeros = count_zeros(counted, group=self.grad_group) if self.count_zeros_in_grad else None
        if not math.isfinite(grad_norm):
            self.zero_grad()
            return StepResult(update_successful=False, grad_norm=grad_norm, num_zeros_in_grad=zeros)
        clip_and_step(self.optimizer, grads, max_norm=self.config.clip_grad, total_norm=grad_norm)
        with torch.no_grad():
            for param, main in zip(self.model_params, self.main_params):
                if main is not param:
                    param.copy_(main)
        return StepResult(update_successful=True, grad_norm=grad_norm, num_zeros_in_grad=zeros)

    def params_norm(self) -> float:
        """L2 norm of all main params (--log-params-norm)."""
        return global_grad_norm(
            self._norm_piece([_local(p) for p in self.main_params]), group=self.grad_group
        )

    def _norm_piece(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors (one per main param) that this rank adds to norms and counts."""
        if self.norm_param_names is None:
            return tensors
        return [
            t for name, t in zip(self.main_param_names, tensors) if name in self.norm_param_names
        ]

    def named_main_params(self) -> dict[str, torch.Tensor]:
        """The fp32 values of every trained param: what checkpoints store as the model."""
        return dict(zip(self.main_param_names, self.main_params))

    def load_main_params(self, named: dict[str, torch.Tensor]) -> None:
        """Set main params (and the model params derived from them) from fp32 values."""
        with torch.no_grad():
            for name, param, main in zip(
                self.main_param_names, self.model_params, self.main_params
            ):
                main.copy_(named[name])
                if main is not param:
                    param.copy_(main)
        if isinstance(self.optimizer, OffloadedAdamW):  # the host update's copies follow
            self.optimizer.refresh_host_params()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
