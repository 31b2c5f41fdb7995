"""Typed configs built once from the validated flags: one per concern."""

from __future__ import annotations

import argparse

import torch

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.fp8.config import Fp8Config
from megatron.core.optimizer import LRScheduleConfig, OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def padded_vocab_size(vocab_size: int, *, divisible_by: int) -> int:
    """Round the tokenizer's vocabulary up so the embedding has aligned rows (as Megatron does)."""
    return -(-vocab_size // divisible_by) * divisible_by


def build_fp8_config(args: argparse.Namespace) -> Fp8Config | None:
    if args.fp8_recipe is None:
        return None
    start = args.num_layers_at_start_in_bf16 if args.first_last_layers_bf16 else 0
    end = args.num_layers_at_end_in_bf16 if args.first_last_layers_bf16 else 0
    return Fp8Config(
        recipe=args.fp8_recipe,
        fp8_format=args.fp8_format,
        margin=args.fp8_margin,
        amax_history_len=args.fp8_amax_history_len,
        amax_compute_algo=args.fp8_amax_compute_algo,
        power_2_scale=args.fp8_power_2_scale,
        fp8_param_gather=args.fp8_param_gather,
        num_layers_at_start_in_bf16=start,
        num_layers_at_end_in_bf16=end,
    )


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """Model parameter and compute dtype: --bf16, --fp16, or fp32."""
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


def build_transformer_config(args: argparse.Namespace, *, vocab_size: int) -> TransformerConfig:
    rows = padded_vocab_size(vocab_size, divisible_by=args.make_vocab_size_divisible_by)
    saved_rows = getattr(args, "padded_vocab_size", None)  # set by --use-checkpoint-args
    if saved_rows is not None:
        if vocab_size > saved_rows:
            from megatron.core.checkpoint_files import CheckpointError

            raise CheckpointError(
                f"--use-checkpoint-args: the checkpoint's embedding has {saved_rows} rows, fewer "
                f"than the tokenizer's {vocab_size} ids; use the tokenizer the model was "
                "trained with."
            )
        rows = saved_rows
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=rows,
        max_sequence_length=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std,
        params_dtype=params_dtype(args),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers,
        apply_layernorm_1p=args.apply_layernorm_1p,
        fp8=build_fp8_config(args),
    )


def build_fsdp_config(args: argparse.Namespace) -> FsdpConfig | None:
    if not args.use_megatron_fsdp:
        return None
    return FsdpConfig(
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        overlap_param_gather=args.overlap_param_gather,
        overlap_grad_reduce=args.overlap_grad_reduce,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
        main_params_dtype=_DTYPES[args.main_params_dtype],
        main_grads_dtype=_DTYPES[args.main_grads_dtype],
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        init_model_with_meta_device=args.init_model_with_meta_device,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
    )


def build_optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )


def build_lr_schedule_config(args: argparse.Namespace) -> LRScheduleConfig:
    return LRScheduleConfig(
        max_lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        warmup_init=args.lr_warmup_init,
        decay_iters=args.lr_decay_iters,
        decay_style=args.lr_decay_style,
        wsd_decay_iters=args.lr_wsd_decay_iters or 0,
        wsd_decay_style=args.lr_wsd_decay_style,
    )
