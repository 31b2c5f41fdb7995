"""The typed configs of a training run: frozen dataclasses, one per concern, bundled in
`TrainingRunConfig`. configs.build_run_config builds them once from the validated flags; every
module below `pretrain()` takes these and never the argparse Namespace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.optimizer import LRScheduleConfig, OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig


def padded_vocab_size(vocab_size: int, *, divisible_by: int) -> int:
    """Round the tokenizer's vocabulary up so the embedding has aligned rows (as Megatron does)."""
    return -(-vocab_size // divisible_by) * divisible_by


def checkpoint_vocab_rows(saved_rows: int, *, vocab_size: int) -> int:
    """--use-checkpoint-args: the checkpoint's embedding rows, which must hold every token id."""
    if vocab_size > saved_rows:
        raise CheckpointError(
            f"--use-checkpoint-args: the checkpoint's embedding has {saved_rows} rows, fewer "
            f"than the tokenizer's {vocab_size} ids; use the tokenizer the model was "
            "trained with."
        )
    return saved_rows


# Flags that change the shapes of parameters: a checkpoint that differs cannot be loaded.
ARCHITECTURE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "swiglu",
    "normalization",
    "position_embedding_type",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The loop: batch geometry, run length, what one step does, when the run stops."""

    micro_batch_size: int
    """Samples per rank per forward (`--micro-batch-size`)."""
    global_batch_size: int
    """Samples per optimizer step over all ranks (`--global-batch-size`)."""
    num_microbatches: int
    """Micro-batches per step: global batch / (micro-batch x data-parallel size)."""
    train_iters: int
    """Optimizer steps of the run (`--train-iters`, or `--train-samples` / global batch)."""
    seq_length: int
    """Tokens per sample (`--seq-length`)."""
    seed: int
    """Seed of the init and of every micro-batch's dropout (`--seed`)."""
    eval_iters: int
    """Global batches per evaluation; 0 disables it (`--eval-iters`)."""
    eval_interval: int
    """Iterations between evaluations (`--eval-interval`)."""
    exit_interval: int | None
    """Stop (and save) at a multiple of this iteration (`--exit-interval`)."""
    exit_duration_in_mins: float | None
    """Stop (and save) once the run took longer (`--exit-duration-in-mins`)."""
    exit_signal_handler: bool
    """SIGTERM stops the run after the current iteration (`--exit-signal-handler`)."""
    check_for_nan_in_loss_and_grad: bool
    """A NaN/Inf loss or grad norm stops the run (`--check-for-nan-in-loss-and-grad`)."""
    calculate_per_token_loss: bool
    """Normalize by the global batch's loss tokens (`--calculate-per-token-loss`)."""
    backward_worker_threads: bool
    """Run backward on autograd's device threads (`--backward-worker-threads`)."""
    deterministic_mode: bool
    """torch deterministic algorithms for the run (`--deterministic-mode`)."""
    empty_unused_memory_level: int
    """Empty the CUDA cache: 1 after forward-backward, 2 also after the step."""


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """The tokenizer flags, as `megatron.core.tokenizer.build_tokenizer` takes them."""

    tokenizer_type: str
    """Which tokenizer (`--tokenizer-type`)."""
    vocab_size: int | None
    """NullTokenizer's vocabulary (`--vocab-size`)."""
    tokenizer_model: str | None
    """HuggingFace tokenizer.json, SentencePiece or tiktoken model (`--tokenizer-model`)."""
    vocab_file: str | None
    """GPT-2 BPE vocab.json (`--vocab-file`)."""
    merge_file: str | None
    """GPT-2 BPE merges.txt (`--merge-file`)."""
    tiktoken_pattern: str | None
    """tiktoken split pattern (`--tiktoken-pattern`)."""
    tiktoken_num_special_tokens: int
    """Special-token ids reserved by tiktoken (`--tiktoken-num-special-tokens`)."""
    tiktoken_special_tokens: list[str] | None
    """Their names (`--tiktoken-special-tokens`)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Tokenizer and datasets of the run."""

    tokenizer: TokenizerConfig
    """The tokenizer the datasets are read with (vocabulary size, end-of-document id)."""
    seq_length: int
    """Tokens per sample (`--seq-length`)."""
    seed: int
    """Seed of the datasets' sample shuffle (`--seed`)."""
    data_path: list[str] | None
    """Weights and prefixes of the blend (`--data-path`); None with `--mock-data`."""
    split: str
    """Train/valid/test shares (`--split`)."""
    mock_data: bool
    """Synthetic data instead of --data-path (`--mock-data`)."""
    data_cache_path: str | None
    """Where the sample indices are cached (`--data-cache-path`)."""
    reset_position_ids: bool
    """Positions restart after each end-of-document (`--reset-position-ids`)."""
    eod_mask_loss: bool
    """No loss on end-of-document tokens (`--eod-mask-loss`)."""
    num_samples: tuple[int, int, int]
    """(train, valid, test) samples asked of the datasets (`requested_num_samples`)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving and loading: where, which format, what to skip, and what a checkpoint must share
    with this run."""

    save: str | None
    """Directory the run saves to (`--save`); None: no saving."""
    load: str | None
    """Directory the run resumes from (`--load`); None: from scratch."""
    save_interval: int | None
    """Iterations between saves (`--save-interval`); the last one is saved too."""
    ckpt_step: int | None
    """The iteration to load instead of the tracker's (`--ckpt-step`)."""
    ckpt_format: str
    """torch, torch_dist or fsdp_dtensor (`--ckpt-format`)."""
    async_save: bool
    """Written by a background thread (`--async-save`)."""
    no_save_optim: bool
    """No optimizer state in the checkpoint (`--no-save-optim`)."""
    no_save_rng: bool
    """No RNG states in the checkpoint (`--no-save-rng`)."""
    no_load_optim: bool
    """Fresh optimizer and schedule on load (`--no-load-optim`)."""
    no_load_rng: bool
    """This run's --seed seeds the RNGs on load (`--no-load-rng`)."""
    finetune: bool
    """Load weights only; iteration, optimizer, RNG and FP8 scaling state start fresh."""
    override_opt_param_scheduler: bool
    """On load, this run's schedule flags win (`--override-opt_param-scheduler`)."""
    use_checkpoint_opt_param_scheduler: bool
    """On load, the saved schedule wins (`--use-checkpoint-opt_param-scheduler`)."""
    use_megatron_fsdp: bool
    """The engine: DDP keeps delayed-scaling state in its own file, Megatron-FSDP sharded."""
    optimizer: str
    """adam or sgd: a checkpoint's optimizer state fits only its own kind."""
    fp8_recipe: str | None
    """This run's FP8 recipe (None: no FP8); delayed scaling has state to restore."""
    fp8_amax_history_len: int
    """Slots of each delayed-scaling amax history, which a checkpoint's must match."""
    train_samples: int | None
    """A --train-samples run counts its schedule in batches of the saved size."""
    global_batch_size: int
    """Samples per step, compared with a --train-samples checkpoint's."""
    architecture: dict[str, object]
    """This run's values of the flags that set parameter shapes (checkpointing's
    ARCHITECTURE_FLAGS), compared with a checkpoint's before loading."""
    saved_args: dict[str, object]
    """What metadata.json stores under "args": every flag with a JSON value, as given."""
    resolved_args: dict[str, object]
    """metadata.json's "resolved_args": the values derived from the flags, under their
    Megatron-LM names (layout.saved_run_flags merges them over "args" for the checks)."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The log line's interval and the TensorBoard/W&B switches."""

    logging_level: int | None
    """Python logging level of every rank (`--logging-level`; None: INFO on rank 0)."""
    log_interval: int
    """Iterations per log line (`--log-interval`)."""
    tensorboard_log_interval: int
    """Iterations between TensorBoard/W&B points (`--tensorboard-log-interval`)."""
    tensorboard_dir: str | None
    """TensorBoard event directory (`--tensorboard-dir`); None: none written."""
    wandb_project: str | None
    """W&B project (`--wandb-project`); None: no W&B run."""
    wandb_exp_name: str | None
    """W&B run name (`--wandb-exp-name`)."""
    wandb_save_dir: str | None
    """W&B local directory (`--wandb-save-dir`, default <save>/wandb)."""
    log_timers_to_tensorboard: bool
    """Step timers as TensorBoard/W&B points (`--log-timers-to-tensorboard`)."""
    log_params_norm: bool
    """The parameters' L2 norm in the log (`--log-params-norm`)."""
    log_num_zeros_in_grad: bool
    """The count of zero grads in the log (`--log-num-zeros-in-grad`)."""
    moe_per_layer_logging: bool
    """Each MoE layer's router losses to TensorBoard/W&B (`--moe-per-layer-logging`)."""
    log_fp8_stats: bool
    """Each Fp8Linear's quantization statistics in the log, TensorBoard, W&B (`--log-fp8-stats`)."""
    log_fp8_stats_interval: int
    """Iterations between those statistics (`--log-fp8-stats-interval`)."""
    notes: tuple[str, ...]
    """One line per given Megatron-LM flag that changes nothing here (printed once)."""
    run_config: dict[str, object]
    """The flags with scalar values, recorded with a W&B run."""


@dataclass(frozen=True, kw_only=True)
class RunHooksConfig:
    """Profiling, memory snapshots and manual garbage collection (run_hooks.py)."""

    profile: bool
    """Profile a range of iterations (`--profile`)."""
    profile_ranks: list[int]
    """Ranks that profile; [] is every rank (`--profile-ranks`)."""
    profile_step_start: int
    """First profiled iteration (`--profile-step-start`)."""
    profile_step_end: int
    """Iteration the profile stops at (`--profile-step-end`)."""
    use_pytorch_profiler: bool
    """torch.profiler instead of an Nsight range (`--use-pytorch-profiler`)."""
    tensorboard_dir: str | None
    """The trace goes to torch_profile/ next to it."""
    record_memory_history: bool
    """Record CUDA allocations for snapshots (`--record-memory-history`)."""
    memory_snapshot_path: str
    """Snapshot file, with _RANK before the extension (`--memory-snapshot-path`)."""
    manual_gc: bool
    """Automatic garbage collection off for the run (`--manual-gc`)."""
    manual_gc_interval: int
    """Iterations between full collections; 0: only around evaluations."""


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """--fp16 loss scaling: a static `loss_scale`, or the dynamic scaler's settings."""

    loss_scale: float | None
    """A static scale (`--loss-scale`); None: dynamic."""
    initial_loss_scale: float
    """The dynamic scale's start (`--initial-loss-scale`)."""
    min_loss_scale: float
    """The dynamic scale's floor (`--min-loss-scale`)."""
    loss_scale_window: float
    """Clean steps before the scale doubles (`--loss-scale-window`)."""
    hysteresis: int
    """Overflowing steps before the scale halves (`--hysteresis`)."""


@dataclass(frozen=True, kw_only=True)
class ModelSetupConfig:
    """How model_setup.py wraps the model and builds its optimizer."""

    seed: int
    """Seed of the parameter init."""
    use_megatron_fsdp: bool
    """Megatron-FSDP (`--use-megatron-fsdp`); else torch DDP."""
    use_torch_fsdp2: bool
    """PyTorch's fully_shard instead (`--use-torch-fsdp2`)."""
    torch_compile: bool
    """Compile each transformer layer's forward (`--torch-compile`)."""
    grad_reduce_in_bf16: bool
    """Reduce grads in bf16 (`--grad-reduce-in-bf16`)."""
    log_num_zeros_in_grad: bool
    """The optimizer counts zero grads (for the log line)."""
    global_batch_size: int
    """Samples per step (`--global-batch-size`)."""
    seq_length: int
    """With the global batch, the size of the FLOP count per iteration."""
    optimizer: OptimizerConfig
    """Adam(W) or SGD settings."""
    fsdp: FsdpConfig | None
    """Megatron-FSDP's settings; None under DDP or FSDP2."""
    loss_scale: LossScaleConfig | None
    """--fp16 loss scaling; None without --fp16."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """The process group and device (initialize.py)."""

    backend: str | None
    """nccl or gloo (`--distributed-backend`); None: nccl with GPUs, else gloo."""
    timeout_minutes: int
    """Collective timeout (`--distributed-timeout-minutes`)."""
    always_use_process_group: bool
    """Megatron-FSDP, FSDP2 and the sharded checkpoint formats need a process group even in
    one process (their collectives and torch.distributed.checkpoint run on one)."""
    use_megatron_fsdp: bool
    """Megatron-FSDP cuts its groups from a data-parallel mesh."""
    num_distributed_optimizer_instances: int
    """HSDP replicas; 1: plain sharding."""
    expert_model_parallel_size: int = 1
    """Ranks splitting the routed experts, inside the DP ranks (`--expert-model-parallel-size`)."""
    tensor_model_parallel_size: int = 1
    """Consecutive ranks splitting each layer, TP inner (`--tensor-model-parallel-size`)."""
    sequence_parallel: bool = False
    """Norms and residuals on sequence shards between TP regions (`--sequence-parallel`)."""


@dataclass(frozen=True, kw_only=True)
class TrainingRunConfig:
    """Every config of one pretrain run, built once by `build_run_config`."""

    training: TrainingConfig
    """The loop."""
    data: DataConfig
    """Tokenizer and datasets."""
    checkpoint: CheckpointConfig
    """Saving and loading."""
    logging: LoggingConfig
    """Log line, TensorBoard and W&B."""
    hooks: RunHooksConfig
    """Profiling, memory snapshots, manual GC."""
    model_setup: ModelSetupConfig
    """Engine, optimizer and loss scaling."""
    distributed: DistributedConfig
    """Process group and device."""
    lr_schedule: LRScheduleConfig
    """The learning-rate schedule, lengths in iterations."""
    model_template: TransformerConfig
    """The model's config but for its vocabulary rows, which the tokenizer decides: use
    `model_config(vocab_size=...)`. Its vocab_size is --make-vocab-size-divisible-by."""
    make_vocab_size_divisible_by: int
    """The embedding rows are padded to a multiple of this."""
    checkpoint_vocab_rows: int | None
    """--use-checkpoint-args: the checkpoint's embedding rows, used instead of padding."""

    def model_config(self, *, vocab_size: int) -> TransformerConfig:
        """The TransformerConfig for a tokenizer of `vocab_size` ids (rows padded)."""
        rows = padded_vocab_size(vocab_size, divisible_by=self.make_vocab_size_divisible_by)
        if self.checkpoint_vocab_rows is not None:
            rows = checkpoint_vocab_rows(self.checkpoint_vocab_rows, vocab_size=vocab_size)
        return dataclasses.replace(self.model_template, vocab_size=rows)
