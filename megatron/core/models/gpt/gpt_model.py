"""GPTModel: embedding -> decoder (transformer layers + final norm) -> output head.

Plain nn.Modules with no parallelism or FP8 logic; FP8 enters only through `build_linear`.
Tensors are batch-first: [B, S, D].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    column_parallel_matmul,
    mark_replicated_sequence_parallel_,
    scatter_to_sequence_parallel_region,
    tensor_parallel_shards,
    vocab_parallel_cross_entropy,
)
from megatron.core.transformer import mup
from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.moe.moe_layer import local_expert_rows
from megatron.core.transformer.mtp import MultiTokenPrediction, mtp_depths
from megatron.core.transformer.recompute import RECOMPUTE_MODULES
from megatron.core.transformer.rope import RotaryEmbedding, rotary_dim
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def check_model_config(config: TransformerConfig) -> None:
    """Raise ValueError naming the field and the fix when the model cannot be built."""
    for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if getattr(config, field) < 1:
            raise ValueError(f"{field}={getattr(config, field)} must be at least 1")
    if config.num_query_groups < 1 or config.num_attention_heads % config.num_query_groups:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be a multiple of "
            f"num_query_groups={config.num_query_groups}; pick --num-query-groups dividing it"
        )
    if config.position_embedding_type not in ("rope", "learned_absolute"):
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r}; use 'rope' or "
            "'learned_absolute'"
        )
    if config.position_embedding_type == "rope" and not config.multi_latent_attention:
        rotary_dim(config)
    if config.recompute_granularity not in (None, "full", "selective"):
        raise ValueError(
            f"recompute_granularity={config.recompute_granularity!r}; use None, 'full' or "
            "'selective'"
        )
    unknown = sorted(set(config.recompute_modules) - set(RECOMPUTE_MODULES))
    if unknown:
        raise ValueError(f"recompute_modules {unknown}; pick from {RECOMPUTE_MODULES}")
    if config.recompute_num_layers < 1:
        raise ValueError(f"recompute_num_layers={config.recompute_num_layers} must be >= 1")
    for field in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(config, field) < 1.0:
            raise ValueError(f"{field}={getattr(config, field)} must be in [0, 1)")


class LanguageModelEmbedding(nn.Module):
    """Token embedding, plus a learned position table when position_embedding_type is
    learned_absolute, followed by dropout (hidden_dropout, as in Megatron-LM).

    With `tensor_parallel` the table's rows are split over its group; under sequence
    parallelism the output is this rank's sequence shard [B, S/tp, D]."""

    def __init__(
        self, config: TransformerConfig, tensor_parallel: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.max_sequence_length = config.max_sequence_length
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is None:
            self.word_embeddings = nn.Embedding(
                config.vocab_size, config.hidden_size, dtype=config.params_dtype
            )
        else:
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                tensor_parallel=tensor_parallel,
                dtype=config.params_dtype,
            )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.mup_embedding_mult = mup.embedding_mult(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x_BSD = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x_BSD = x_BSD + self.position_embeddings(position_ids)
        if self.mup_embedding_mult != 1.0:
            x_BSD = x_BSD * self.mup_embedding_mult
        if self.tensor_parallel is not None and self.tensor_parallel.sequence_parallel:
            x_BSD = scatter_to_sequence_parallel_region(x_BSD, self.tensor_parallel.group)
        return self.embedding_dropout(x_BSD)


class GPTModel(nn.Module):
    """Decoder-only GPT.

    Structure (the FSDP engine relies on it): `embedding`, `decoder.layers` (one
    TransformerLayer per layer), `decoder.final_norm`, `output_layer` (None when the head is
    tied to `embedding.word_embeddings.weight`), `rotary_pos_emb` (None without rope),
    `mtp` (multi-token prediction, None without --mtp-num-layers; its losses need labels).

    Built normally, parameters are initialized with `init_parameter_(seed=seed)`. Built under
    `with torch.device("meta")` nothing is initialized; after materializing (e.g. `to_empty`)
    call `reset_parameters(seed)` (or init unit by unit with `init_parameter_`) and
    `init_buffers(device)`, because the rope frequencies are non-persistent buffers.

    With --num-experts, the MoE layers split their routed experts over
    `expert_parallel_group` (None: this rank holds all of them).

    With `tensor_parallel`, the layers built through `build_linear` and the embedding are
    split over its group, the output head is vocab-parallel: logits are this rank's
    vocabulary slice [B, S, V/tp] and the loss is the vocab-parallel cross-entropy. Under
    sequence parallelism the caller sums the marked gradients over TP
    (`tensor_parallel.all_reduce_sequence_parallel_grads`) after backward.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        seed: int = 0,
        expert_parallel_group: dist.ProcessGroup | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        check_model_config(config)
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.mup_output_mult = mup.output_mult(config)
        self.embedding = LanguageModelEmbedding(config, tensor_parallel)
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope" or config.multi_latent_attention:
            self.rotary_pos_emb = RotaryEmbedding(config)  # MLA always rotates its q_pe, k_pe
        self.decoder = TransformerBlock(
            config, expert_parallel_group=expert_parallel_group, tensor_parallel=tensor_parallel
        )
        self.cross_entropy = per_token_cross_entropy
        """Logits [B, S, V] and labels [B, S] -> the per-token loss [B, S] in fp32, the main
        loss's and MTP's (without tensor parallelism); `--torch-compile` compiles it."""
        self.mtp = None
        if mtp_depths(config):
            self.mtp = MultiTokenPrediction(
                config,
                expert_parallel_group=expert_parallel_group,
                moe_metrics=self.decoder.moe_metrics,
            )
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            # Never FP8: logits feed a softmax over the whole vocabulary.
            self.output_layer = self._build_output_layer(config, tensor_parallel)
        if tensor_parallel is not None and tensor_parallel.sequence_parallel:
            mark_replicated_sequence_parallel_(self, skip_prefixes=("embedding.",))
        if not self.embedding.word_embeddings.weight.is_meta:
            self.reset_parameters(seed)

    @staticmethod
    def _build_output_layer(
        config: TransformerConfig, tensor_parallel: TensorParallel | None
    ) -> nn.Module:
        if tensor_parallel is None:
            return nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=config.params_dtype
            )
        return ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            tensor_parallel=tensor_parallel,
            dtype=config.params_dtype,
        )

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Re-initialize every parameter from (seed, its name); see init.py. A routed-expert
        weight is drawn for all num_moe_experts and this rank keeps its experts' rows; a
        tensor-parallel weight is drawn at its full shape and this rank keeps its shard."""
        expert_rows = local_expert_rows(self)
        tp_owners = tensor_parallel_shards(self)
        for name, param in self.named_parameters():
            rows = expert_rows.get(name)
            owner = tp_owners.get(name)
            if owner is not None:
                leaf = name.rsplit(".", 1)[-1]
                full = param.new_empty(owner.full_shape(leaf))
                init_parameter_(full, name=name, config=self.config, seed=seed)
                param.copy_(owner.shard_of_full(leaf, full))
                continue
            if rows is None:
                init_parameter_(param, name=name, config=self.config, seed=seed)
                continue
            full = param.new_empty((self.config.num_moe_experts, *param.shape[1:]))
            init_parameter_(full, name=name, config=self.config, seed=seed)
            param.copy_(full[rows])

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recreate the buffers (rope inverse frequencies, MoE routers' expert-bias state)
        on `device` (default: the device of the embedding weight). Needed after meta
        construction."""
        if device is None:
            device = self.embedding.word_embeddings.weight.device
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device)

    def output_weight(self) -> torch.Tensor:
        """The [V, D] output-head weight: the embedding table when tied."""
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def logits(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The output head: x W^T with the (tied or untied) output weight, times muP's mult."""
        if self.tensor_parallel is None:
            logits_BSV = F.linear(x_BSD, self.output_weight())
        else:  # this rank's vocabulary slice
            logits_BSV = column_parallel_matmul(x_BSD, self.output_weight(), self.tensor_parallel)
        if self.mup_output_mult != 1.0:
            logits_BSV = logits_BSV * self.mup_output_mult
        return logits_BSV

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V], or with labels [B, S] the per-token
        cross-entropy loss [B, S] in fp32 (logits upcast to fp32 first). With `mtp` and
        labels, the MTP losses (over `loss_mask`, default all ones) go into backward and
        `mtp.metrics`, not into the returned loss."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if self.embedding.position_embeddings is not None and seq > self.config.max_sequence_length:
            raise ValueError(
                f"sequence length {seq} exceeds max_sequence_length="
                f"{self.config.max_sequence_length} of the learned position table; raise "
                "--seq-length/max_sequence_length or use rope"
            )
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        x_BSD = self.embedding(input_ids, position_ids)
        rotary_cos_sin = None
        if self.rotary_pos_emb is not None:
            rotary_cos_sin = self.rotary_pos_emb(position_ids)
        x_BSD = self.decoder(x_BSD, rotary_cos_sin)
        if self.mtp is not None and labels is not None:
            batch = dict(input_ids=input_ids, position_ids=position_ids, labels=labels)
            batch["loss_mask"] = torch.ones_like(labels) if loss_mask is None else loss_mask
            x_BSD, _ = self.mtp(
                x_BSD,
                embed=self.embedding,
                logits=self.logits,
                cross_entropy=self.cross_entropy,
                batch=batch,
                rotary_cos_sin=rotary_cos_sin,
            )
        logits_BSV = self.logits(x_BSD)
        if labels is None:
            return logits_BSV
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if self.tensor_parallel is not None:
            return vocab_parallel_cross_entropy(logits_BSV, labels, self.tensor_parallel.group)
        return self.cross_entropy(logits_BSV, labels)


def per_token_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The cross-entropy loss [B, S] in fp32 of each token, the logits upcast to fp32 first.
    Eager, backward keeps the fp32 log-softmax [B, S, V]; compiled (`--torch-compile`), the
    upcast fuses into the softmax and backward keeps the logits as they came (bf16) and two
    fp32 numbers per token."""
    loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="none")
    # A tensor of its own, not a view of the flat loss: FSDP2 hooks its backward onto the
    # root module's outputs, and warns for a view (an in-place op on one drops the hook).
    # The copy is [B, S] fp32, small beside the logits; Megatron-LM copies here as well.
    return loss.view_as(labels_BS).clone()
