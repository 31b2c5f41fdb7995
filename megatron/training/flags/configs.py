"""Typed configs built once from the validated flags: one per concern.

`build_run_config` is the only place below `parse_args` that reads the argparse Namespace: it
turns the validated flags into the frozen dataclasses of run_config.py (training loop, data,
checkpointing, logging, run hooks, model setup, process group) bundled in `TrainingRunConfig`,
and computes the values derived from several flags (`resolved_flags`: the defaults that depend on
other flags; micro-batches per step, the learning-rate schedule's lengths in iterations, the
samples asked of each split). checks.py validates the same resolved copy; the Namespace that
parse_args returns keeps the flags as given. Everything `pretrain`
calls takes these configs, never the Namespace (tests/unit_tests/training/test_no_namespace.py
checks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.environment import env_int
from megatron.core.fp8.config import Fp8Config
from megatron.core.optimizer import LRScheduleConfig, OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flags import readings
from megatron.training.flags.checkpoint_args import checkpoint_run_values
from megatron.training.flags.compile import resolve_compile_default
from megatron.training.flags.megatron_lm_checks import resolve_megatron_lm_args
from megatron.training.flags.mla import mla_config_kwargs
from megatron.training.flags.moe import moe_config_values, moe_notes
from megatron.training.flags.mup import MUP_CONFIG_FIELDS, mup_width_mult
from megatron.training.flags.recompute import recompute_config_kwargs, recompute_notes
from megatron.training.flags.run_config import (
    ARCHITECTURE_FLAGS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    LossScaleConfig,
    ModelSetupConfig,
    RunHooksConfig,
    TokenizerConfig,
    TrainingConfig,
    TrainingRunConfig,
    checkpoint_vocab_rows,
    padded_vocab_size,
)
from megatron.training.flags.tensor_parallel import vocab_padding_multiple

_DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16, fp64=torch.float64)


def resolved_flags(
    args: argparse.Namespace, *, world_size: int | None = None
) -> argparse.Namespace:
    """A copy of the flags with every default that depends on other flags filled in, as
    Megatron-LM resolves them (the global batch, the run length, --max-position-embeddings, the
    engine a Megatron-LM flag means, the checkpoint format, the FP8 defaults). The one definition
    of these rules. Raises ValueError for a Megatron-LM value that cannot be honoured."""
    flags = argparse.Namespace(**vars(args))
    # Default: the data-parallel size torchrun/Slurm announce (1 for a plain `python` launch).
    flags.world_size = world_size if world_size is not None else env_int("WORLD_SIZE", 1)
    # Tensor-parallel ranks share one replica (validate_tensor_parallel_args checks the split).
    flags.data_parallel_size = flags.world_size // max(flags.tensor_model_parallel_size, 1)
    flags.padded_vocab_size, saved_format = checkpoint_run_values(args)
    flags.megatron_lm_notes = resolve_megatron_lm_args(flags)
    resolve_compile_default(flags)  # --torch-compile's default: on with CUDA, off without
    if flags.global_batch_size is None:
        flags.global_batch_size = flags.micro_batch_size * flags.data_parallel_size
    if flags.train_samples is not None and flags.train_iters is None:
        # Megatron-LM: the iterations are the whole global batches the samples make.
        flags.train_iters = flags.train_samples // max(flags.global_batch_size, 1)
    elif flags.train_iters is None:
        flags.train_iters = 100
    if flags.max_position_embeddings is None:
        flags.max_position_embeddings = flags.seq_length
    # Megatron-LM's llama scripts' unquoted arrays pass "--split '99,1,0'" quotes and all.
    if len(flags.split) >= 2 and flags.split[0] == flags.split[-1] and flags.split[0] in "'\"":
        flags.split = flags.split[1:-1]
    readings.resolve_query_groups(flags)
    _resolve_data_parallel_engine(flags)
    if flags.ckpt_format is None:  # --use-checkpoint-args: the checkpoint's format
        # EP / TP: ranks hold different experts / shards, which torch_dist saves as full tensors.
        parallel = max(flags.expert_model_parallel_size, flags.tensor_model_parallel_size)
        sharded = flags.use_megatron_fsdp or flags.use_torch_fsdp2 or parallel > 1
        flags.ckpt_format = saved_format or ("torch_dist" if sharded else "torch")
    if flags.wandb_project and flags.wandb_save_dir is None and flags.save is not None:
        flags.wandb_save_dir = os.path.join(flags.save, "wandb")  # Megatron-LM's default
    if flags.fp8_recipe is None and flags.fp8_format is not None:
        flags.fp8_recipe = "delayed"  # Megatron-LM: --fp8-format alone trains delayed scaling
    if flags.fp8_wgrad_input_from_activation is None or flags.fp8_recipe is None:
        flags.fp8_wgrad_input_from_activation = flags.fp8_recipe is not None
    if flags.fp8_recipe is not None and flags.fp8_format is None:
        flags.fp8_format = "hybrid"
        flags.megatron_lm_notes.append(readings.RECIPE_ALONE_NOTE.format(flags.fp8_recipe))
    # After the FP8 and compile defaults: these read the recipe (and compile).
    flags.megatron_lm_notes += moe_notes(flags) + recompute_notes(flags)
    return flags


def _resolve_data_parallel_engine(flags: argparse.Namespace) -> None:
    """The engine a Megatron-LM line means: --use-distributed-optimizer is Megatron-FSDP's 'optim'
    strategy (--ckpt-format torch_dist alone stays under DDP, which writes that format too)."""
    if flags.use_distributed_optimizer and not (flags.use_megatron_fsdp or flags.use_torch_fsdp2):
        flags.use_megatron_fsdp = True
        flags.data_parallel_sharding_strategy = "optim"
        flags.megatron_lm_notes.append(
            "--use-distributed-optimizer: main params and optimizer state are sharded "
            "over the data-parallel ranks by Megatron-FSDP's 'optim' strategy."
        )
    if flags.data_parallel_sharding_strategy is None:
        flags.data_parallel_sharding_strategy = "optim_grads_params"


def _from_flags(cls: type, args: argparse.Namespace, **derived: object):
    """A `cls` whose fields are the flags of the same name, except those given in `derived`
    (computed from several flags, or converted)."""
    fields = (field.name for field in dataclasses.fields(cls) if field.name not in derived)
    return cls(**{name: getattr(args, name) for name in fields}, **derived)


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
        wgrad_input_from_activation=args.fp8_wgrad_input_from_activation,
        num_layers_at_start_in_bf16=start,
        num_layers_at_end_in_bf16=end,
    )


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """Model parameter and compute dtype: --bf16, --fp16, or fp32."""
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


def build_transformer_config(args: argparse.Namespace, *, vocab_size: int) -> TransformerConfig:
    flags = resolved_flags(args, world_size=1)  # the model does not depend on the world size
    rows = padded_vocab_size(vocab_size, divisible_by=vocab_padding_multiple(args))
    if flags.padded_vocab_size is not None:  # --use-checkpoint-args
        rows = checkpoint_vocab_rows(flags.padded_vocab_size, vocab_size=vocab_size)
    return _transformer_config(flags, vocab_rows=rows)


def model_template(args: argparse.Namespace) -> TransformerConfig:
    """The model's TransformerConfig from resolved flags, vocabulary rows aside (the run
    config's template, and the parse-time MoE checks)."""
    return _transformer_config(args, vocab_rows=args.make_vocab_size_divisible_by)


def _transformer_config(args: argparse.Namespace, *, vocab_rows: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_rows,
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
        apply_layernorm_1p=args.apply_layernorm_1p,
        fp8=build_fp8_config(args),
        **{name: getattr(args, name) for name in MUP_CONFIG_FIELDS},
        **mla_config_kwargs(args),
        **moe_config_values(args),
        **recompute_config_kwargs(args),
    )


def build_fsdp_config(args: argparse.Namespace) -> FsdpConfig | None:
    if not args.use_megatron_fsdp:
        return None
    return _from_flags(
        FsdpConfig,
        args,
        main_params_dtype=_DTYPES[args.main_params_dtype],
        main_grads_dtype=_DTYPES[args.main_grads_dtype],
    )


def build_optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    # moment_scaling has no Megatron-LM flag: TransformerEngine's rule, the config's default.
    scaling = OptimizerConfig.moment_scaling
    return _from_flags(
        OptimizerConfig, args, mup_width_mult=mup_width_mult(args), moment_scaling=scaling
    )


def num_microbatches(args: argparse.Namespace) -> int:
    """Micro-batches per step: the global batch over micro-batch size x data-parallel size."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def lr_lengths_before_fraction(args: argparse.Namespace) -> tuple[float, float, float | None]:
    """(warmup, decay, WSD decay) in iterations, before --lr-warmup-fraction. A --train-samples
    run gives them in samples (Megatron-LM); the scheduler counts iterations, so each becomes
    samples / global batch size (a fractional length gives the learning rates of a
    sample-counting schedule at a constant batch size). The decay defaults to the run length."""
    if args.train_samples is not None:
        batch = args.global_batch_size
        decay_samples = args.lr_decay_samples
        decay = (decay_samples if decay_samples is not None else args.train_samples) / batch
        wsd = args.lr_wsd_decay_iters
        if args.lr_wsd_decay_samples is not None:
            wsd = args.lr_wsd_decay_samples / batch
        return args.lr_warmup_samples / batch, decay, wsd
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    return args.lr_warmup_iters, decay, args.lr_wsd_decay_iters


def lr_lengths(args: argparse.Namespace) -> tuple[float, float, float | None]:
    """(warmup, decay, WSD decay) in iterations; --lr-warmup-fraction sets the warmup to that
    fraction of the decay (Megatron-LM)."""
    warmup, decay, wsd = lr_lengths_before_fraction(args)
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup, decay, wsd


def build_lr_schedule_config(args: argparse.Namespace) -> LRScheduleConfig:
    warmup, decay, wsd = lr_lengths(args)
    return LRScheduleConfig(
        max_lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=warmup,
        warmup_init=args.lr_warmup_init,
        decay_iters=decay,
        decay_style=args.lr_decay_style,
        wsd_decay_iters=wsd or 0,
        wsd_decay_style=args.lr_wsd_decay_style,
    )


def requested_num_samples(args: argparse.Namespace) -> tuple[int, int, int]:
    """(train, valid, test) samples asked of the datasets, as Megatron-LM counts them.

    The sample order depends on these counts (megatron-core shuffles all the epochs a count
    needs), so they follow Megatron-LM for a run to see the samples a Megatron-LM run sees:
    valid is sized for every evaluation of the run, test for one.
    """
    train = args.train_samples or args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid = evaluations * args.eval_iters * args.global_batch_size
    return train, valid, args.eval_iters * args.global_batch_size


def _json_value(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list))


def saved_args(
    given: argparse.Namespace, flags: argparse.Namespace
) -> tuple[dict[str, object], dict[str, object]]:
    """metadata.json's "args" (the JSON-valued flags as given) and "resolved_args" (the values
    resolved_flags and the schedule derive from them, under Megatron-LM's names; merged over
    "args" they are what a checkpoint from before the split stored as "args")."""
    warmup, decay, wsd = lr_lengths(flags)
    args = {key: value for key, value in vars(given).items() if _json_value(value)}
    resolved = {
        key: value
        for key, value in vars(flags).items()
        if _json_value(value) and (key not in args or args[key] != value)
    }
    resolved.update(
        num_microbatches=num_microbatches(flags),
        lr_decay_iters=decay,
        lr_warmup_iters=warmup,
        lr_wsd_decay_iters=wsd,
    )
    return args, resolved


def build_training_config(args: argparse.Namespace) -> TrainingConfig:
    return _from_flags(TrainingConfig, args, num_microbatches=num_microbatches(args))


def build_data_config(args: argparse.Namespace) -> DataConfig:
    return _from_flags(
        DataConfig,
        args,
        tokenizer=_from_flags(TokenizerConfig, args),
        data_path=None if args.mock_data else list(args.data_path),
        num_samples=requested_num_samples(args),
    )


def build_checkpoint_config(
    given: argparse.Namespace, args: argparse.Namespace
) -> CheckpointConfig:
    saved, resolved = saved_args(given, args)
    return _from_flags(
        CheckpointConfig,
        args,
        architecture={flag: getattr(args, flag) for flag in ARCHITECTURE_FLAGS},
        saved_args=saved,
        resolved_args=resolved,
    )


def build_logging_config(given: argparse.Namespace, args: argparse.Namespace) -> LoggingConfig:
    saved, resolved = saved_args(given, args)
    return _from_flags(
        LoggingConfig,
        args,
        notes=tuple(args.megatron_lm_notes),
        run_config={
            key: value
            for key, value in {**saved, **resolved}.items()
            if isinstance(value, (int, float, str, bool))
        },
    )


def build_run_hooks_config(args: argparse.Namespace) -> RunHooksConfig:
    return _from_flags(RunHooksConfig, args, profile_ranks=list(args.profile_ranks))


def build_loss_scale_config(args: argparse.Namespace) -> LossScaleConfig | None:
    if not args.fp16:
        return None
    return _from_flags(LossScaleConfig, args)


def build_model_setup_config(args: argparse.Namespace) -> ModelSetupConfig:
    return _from_flags(
        ModelSetupConfig,
        args,
        optimizer=build_optimizer_config(args),
        fsdp=build_fsdp_config(args),
        loss_scale=build_loss_scale_config(args),
    )


def build_distributed_config(args: argparse.Namespace) -> DistributedConfig:
    sharded_format = args.ckpt_format in ("torch_dist", "fsdp_dtensor")
    return DistributedConfig(
        backend=args.distributed_backend,
        timeout_minutes=args.distributed_timeout_minutes,
        always_use_process_group=args.use_megatron_fsdp or args.use_torch_fsdp2 or sharded_format,
        use_megatron_fsdp=args.use_megatron_fsdp,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_model_parallel_size=args.expert_model_parallel_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
    )


def build_run_config(
    given: argparse.Namespace, *, world_size: int | None = None
) -> TrainingRunConfig:
    """Every config of the run from the validated flags (`parse_args`'s result) as
    resolved_flags resolves them for `world_size` ranks (default: the launcher's)."""
    args = resolved_flags(given, world_size=world_size)
    return TrainingRunConfig(
        training=build_training_config(args),
        data=build_data_config(args),
        checkpoint=build_checkpoint_config(given, args),
        logging=build_logging_config(given, args),
        hooks=build_run_hooks_config(args),
        model_setup=build_model_setup_config(args),
        distributed=build_distributed_config(args),
        lr_schedule=build_lr_schedule_config(args),
        model_template=model_template(args),
        make_vocab_size_divisible_by=vocab_padding_multiple(args),
        checkpoint_vocab_rows=args.padded_vocab_size,
    )
