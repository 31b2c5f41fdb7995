"""Optimizers over main params (precision-aware AdamW, CPU offload), grad-norm clipping and LR
schedules."""

from megatron.core.optimizer.clip_grads import clip_and_step, clip_grads_, global_grad_norm
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.fused_adamw import FusedAdamW
from megatron.core.optimizer.lr_scheduler import (
    LRScheduleConfig,
    OptimizerParamScheduler,
    learning_rate_at,
)
from megatron.core.optimizer.offload import OffloadedAdamW, offload_count
from megatron.core.optimizer.optimizer import (
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    StepResult,
    build_torch_optimizer,
    check_optimizer_config,
    count_zeros,
    is_embedding_or_output_parameter,
    is_no_weight_decay,
    state_bytes_by_dtype,
    unscale_grads_,
)
from megatron.core.optimizer.precision import (
    StatePrecision,
    check_main_dtypes,
    state_precision,
)

__all__ = [
    "LRScheduleConfig",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "FusedAdamW",
    "OffloadedAdamW",
    "OptimizerParamScheduler",
    "StatePrecision",
    "StepResult",
    "build_torch_optimizer",
    "check_main_dtypes",
    "check_optimizer_config",
    "clip_and_step",
    "clip_grads_",
    "count_zeros",
    "global_grad_norm",
    "is_embedding_or_output_parameter",
    "is_no_weight_decay",
    "learning_rate_at",
    "offload_count",
    "state_bytes_by_dtype",
    "state_precision",
    "unscale_grads_",
]
