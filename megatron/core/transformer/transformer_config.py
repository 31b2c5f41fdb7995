"""The model's configuration: one typed dataclass, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron.core.fp8.config import Fp8Config


def resolved_shape(
    *,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int | None,
    num_query_groups: int | None,
    kv_channels: int | None,
) -> dict[str, int]:
    """The sizes that an omitted flag stands for (Megatron-LM's defaults): FFN 4 x hidden, one
    query group per head, kv channels hidden / heads. A checkpoint check compares these, so that
    --kv-channels 16 matches a checkpoint saved without it when hidden / heads is 16."""
    return {
        "ffn_hidden_size": 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size,
        "num_query_groups": num_attention_heads if num_query_groups is None else num_query_groups,
        "kv_channels": hidden_size // num_attention_heads if kv_channels is None else kv_channels,
    }


@dataclass(kw_only=True)
class TransformerConfig:
    """Architecture and numerics of a GPT. Field names follow Megatron-LM's flags."""

    num_layers: int
    """Number of transformer layers (`--num-layers`)."""

    hidden_size: int
    """Width of the residual stream (`--hidden-size`)."""

    num_attention_heads: int
    """Number of query heads (`--num-attention-heads`)."""

    vocab_size: int
    """Rows of the embedding table, already padded (`--make-vocab-size-divisible-by`)."""

    max_sequence_length: int
    """Longest sequence the model sees (`--seq-length`); sizes learned position embeddings."""

    ffn_hidden_size: int | None = None
    """Inner width of the MLP (`--ffn-hidden-size`); default 4 x hidden_size."""

    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (`--num-query-groups`); None means one per
    query head (plain multi-head attention)."""

    kv_channels: int | None = None
    """Width of one attention head (`--kv-channels`); default hidden_size / num_attention_heads."""

    position_embedding_type: Literal["rope", "learned_absolute"] = "learned_absolute"
    """Rotary embeddings on queries and keys, or a learned table added to the token embedding."""

    rotary_base: int = 10000
    """Base of the rotary frequencies (`--rotary-base`)."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotate (`--rotary-percent`)."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Pre-norm flavour used before attention, before the MLP and before the output head."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (`--norm-epsilon`)."""

    swiglu: bool = False
    """SwiGLU MLP (gate and up projections fused in one Linear) instead of GeLU (`--swiglu`)."""

    add_bias_linear: bool = True
    """Biases on every transformer Linear; `--disable-bias-linear` turns them off."""

    hidden_dropout: float = 0.1
    """Dropout on the outputs of attention and MLP before the residual add (`--hidden-dropout`)."""

    attention_dropout: float = 0.1
    """Dropout on attention probabilities (`--attention-dropout`)."""

    untie_embeddings_and_output_weights: bool = False
    """Separate output-head weight instead of reusing the embedding table."""

    init_method_std: float = 0.02
    """Std of the normal init of every weight; output projections are scaled by
    1/sqrt(2 * num_layers) as in Megatron-LM."""

    params_dtype: torch.dtype = torch.float32
    """Dtype of the model's parameters and compute (`--bf16` makes it torch.bfloat16)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute: whole layers (`full`) or the `recompute_modules` of each layer
    (`selective`)."""

    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With selective recompute (Megatron-LM's `--recompute-modules`): the submodules run under
    activation checkpoint, keeping only their inputs (recompute.py): `core_attn` (the S x S
    attention core), `mlp` (a dense layer's MLP), `moe` (the whole MoE layer: router, dispatch,
    experts, shared experts) and `shared_experts`."""

    recompute_method: Literal["uniform", "block"] = "uniform"
    """With full recompute (Megatron-LM's `--recompute-method`): `uniform` checkpoints every
    chunk of recompute_num_layers consecutive layers; `block` checkpoints only the first
    recompute_num_layers layers, one by one, and keeps the activations of the rest."""

    recompute_num_layers: int = 1
    """With full recompute: layers per checkpointed chunk (uniform) or layers recomputed (block)."""

    apply_layernorm_1p: bool = False
    """Zero-centred norm scales (Megatron-LM's `--apply-layernorm-1p`): the stored weight w
    starts at 0 and the norm multiplies by 1 + w, so weight decay pulls the scale toward 1."""

    use_mup: bool = False
    """muP (Megatron-LM's `--use-mup`): width-scaled init, attention and logits scales and
    per-group Adam lr/eps (megatron/core/transformer/mup.py has the formulas)."""

    mup_base_hidden_size: int | None = None
    """Hidden size of the muP base model (`--mup-base-hidden-size`); None: hidden_size."""

    mup_base_head_dim: int | None = None
    """Head dim of the muP base model (`--mup-base-head-dim`); None: softmax scale 1 / d^p."""

    mup_attn_scale_power: float = 1.0
    """Power p of the muP softmax scale sqrt(base head dim) / kv_channels^p."""

    mup_embedding_mult: float = 1.0
    """Multiplier of the embedding output under muP (`--mup-embedding-mult`)."""

    mup_output_mult: float = 1.0
    """Multiplier of the logits under muP (`--mup-output-mult`; 1.0: 1 / width mult)."""

    fp8: Fp8Config | None = None
    """FP8 settings for transformer Linears; None keeps every Linear in params_dtype."""

    # Mixture of Experts (Megatron-LM's names and defaults; checked by
    # megatron.core.transformer.moe.config_checks.check_moe_config).

    num_moe_experts: int | None = None
    """Routed experts per MoE layer (`--num-experts`); None builds a dense model."""

    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert (`--moe-ffn-hidden-size`); default ffn_hidden_size."""

    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE (`--moe-layer-freq`): an int N makes every N-th layer MoE
    (layers 0, N, 2N, ... counted from 0), a list of num_layers 0/1 flags gives the pattern."""

    moe_shared_expert_intermediate_size: int | None = None
    """Total inner width of the shared experts run on every token
    (`--moe-shared-expert-intermediate-size`); None means no shared experts."""

    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x w) with a learned [1, hidden] w
    (Megatron-LM's `moe_shared_expert_gate`, Qwen2-MoE style)."""

    moe_grouped_gemm: bool = False
    """`--moe-grouped-gemm`; the experts here always run through one grouped GEMM, so this is
    accepted and changes nothing."""

    moe_router_topk: int = 2
    """Experts chosen per token (`--moe-router-topk`)."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Score of the router logits (`--moe-router-score-function`)."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k instead of over the k chosen logits
    (`--moe-router-pre-softmax`); needed with top-1 softmax routing."""

    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (`--moe-router-num-groups`)."""

    moe_router_group_topk: int | None = None
    """Groups each token may pick experts from (`--moe-router-group-topk`)."""

    moe_router_topk_scaling_factor: float | None = None
    """Multiplier of the chosen experts' probabilities (`--moe-router-topk-scaling-factor`)."""

    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Dtype of the router GEMM and scores (`--moe-router-dtype`); None: the input's dtype."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (`--moe-router-enable-expert-bias`): a per-expert bias added to
    the scores for the choice only, moved after each step toward balanced load."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of each expert-bias update (`--moe-router-bias-update-rate`)."""

    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = (
        "aux_loss"
    )
    """Load balancing (`--moe-router-load-balancing-type`)."""

    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`); 0 turns it off."""

    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss (`--moe-z-loss-coeff`); None turns it off."""

    moe_expert_capacity_factor: float | None = None
    """Expert capacity = ceil(tokens * topk / experts * factor) (`--moe-expert-capacity-factor`);
    None is dropless."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Past capacity, keep the highest-probability tokens or the earliest ones
    (`--moe-token-drop-policy`)."""

    moe_pad_expert_input_to_capacity: bool = False
    """Give every expert exactly `capacity` tokens, padding with zero-probability ones
    (`--moe-pad-expert-input-to-capacity`); needs a capacity factor."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    """How tokens reach their experts' expert-parallel ranks (`--moe-token-dispatcher-type`)."""

    moe_permute_fusion: bool = False
    """`--moe-permute-fusion`: accepted; the permutation is one index gather either way."""

    expert_model_parallel_size: int = 1
    """Ranks the routed experts are split over (`--expert-model-parallel-size`)."""

    # DeepSeek-V3-style attention and multi-token prediction (Megatron-LM's names and defaults;
    # checked by megatron.core.transformer.mla.check_mla_config).

    qk_layernorm: bool = False
    """Norm (`normalization`) on queries and keys (`--qk-layernorm`): per head over kv_channels
    in standard attention, on the q and kv latents in multi-latent attention."""

    multi_latent_attention: bool = False
    """Multi-latent attention (`--multi-latent-attention`, megatron/core/transformer/mla.py)."""

    q_lora_rank: int | None = None
    """Rank of the query compression (`--q-lora-rank`); None: one full query projection."""

    kv_lora_rank: int = 32
    """Rank of the joint key-value compression (`--kv-lora-rank`)."""

    qk_head_dim: int = 128
    """Per-head query/key channels without position embedding (`--qk-head-dim`)."""

    qk_pos_emb_head_dim: int = 64
    """Per-head query/key channels that rotate, the key part shared by all heads
    (`--qk-pos-emb-head-dim`)."""

    v_head_dim: int = 128
    """Per-head value channels (`--v-head-dim`)."""

    rope_type: Literal["rope", "yarn"] | None = None
    """Rotary frequencies (`--rope-type`); None: yarn with multi-latent attention, else rope."""

    rotary_scaling_factor: float = 1.0
    """YaRN context-extension factor s (`--rotary-scaling-factor`)."""

    mscale: float = 1.0
    """YaRN mscale (`--mscale`): cos and sin times m(s, mscale) / m(s, mscale_all_dim)."""

    mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim (`--mscale-all-dim`): MLA's softmax scale is
    m(s, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)."""

    original_max_position_embeddings: int = 4096
    """YaRN's pre-extension context (`--yarn-original-max-position-embeddings`)."""

    beta_fast: float = 32.0
    """YaRN's high-rotation bound (`--yarn-beta-fast`)."""

    beta_slow: float = 1.0
    """YaRN's low-rotation bound (`--yarn-beta-slow`)."""

    mtp_num_layers: int | None = None
    """Multi-token prediction depths (`--mtp-num-layers`, megatron/core/transformer/mtp.py)."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean MTP loss added to the training loss (`--mtp-loss-scaling-factor`)."""

    def __post_init__(self) -> None:
        self.recompute_modules = tuple(self.recompute_modules)  # a saved config holds a list
        shape = resolved_shape(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
        )
        self.ffn_hidden_size = shape["ffn_hidden_size"]
        self.num_query_groups = shape["num_query_groups"]
        self.kv_channels = shape["kv_channels"]
        if self.use_mup and self.mup_base_hidden_size is None:
            self.mup_base_hidden_size = self.hidden_size  # width mult 1, as Megatron-LM
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.rope_type is None:
            self.rope_type = "yarn" if self.multi_latent_attention else "rope"
