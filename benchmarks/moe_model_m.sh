#!/usr/bin/env bash
# Model M (docs/PERFORMANCE.md): a Qwen3-MoE-style GPT (8 layers, hidden 2048, 32 heads / 4 query
# groups, 64 experts top-8, moe-ffn 768, seq 4096, micro-batch 2) at DP=1 / EP=1 on one H200,
# every row in one job (issue 38, acceptance 5):
#   fsdp2            the FSDP2 bf16 MoE peer (benchmarks/moe_peer.py: torch._grouped_mm experts,
#                    compiled, fused AdamW, clip 1.0);
#   torchao_rowwise  that peer with torchao's float8 rowwise grouped GEMMs for the experts;
#   bf16             pretrain_gpt.py with Megatron-FSDP (ZeRO-3) and --moe-grouped-gemm (compiled
#                    by default on CUDA);
#   tensorwise, blockwise, <recipe>: the same with FP8 parameters of that recipe;
#   <recipe>_nofusion: that row with --no-gradient-accumulation-fusion (bf16 wgrads + a cast pass).
# One JSON line per row in $OUT/model_m.jsonl (step_ms: median logged iteration after WARMUP).
# The torchao row needs torchao importable, e.g. (the device's offline wheel):
#   pip install --no-index --no-deps --target /tmp/site .whl/torchao-*.whl
#   PYTHONPATH=/tmp/site ROWS="fsdp2 torchao_rowwise bf16 tensorwise blockwise" bash benchmarks/moe_model_m.sh
# PRINT_ONLY=1 (with one row in ROWS): print that row's pretrain_gpt.py flags and stop.
# SMALL=1: model M-small (~125M active parameters: 8 layers, hidden 768, 12 heads / 4 groups,
# 64 experts top-8, moe-ffn 256, seq 2048); TINY=1: CPU sizes for the smoke test (gloo).
# GBS=16 (default: the micro-batch, 2): 8 micro-batches of 2 per optimizer step in every row, as
# a run with gradient accumulation (the optimizer step's share of the step time divided by 8).
# DEEPSEEK=1 (issue 39, acceptance 4): the DeepSeek-V3-style model M: multi-latent attention
# (16 heads, q-lora 768, kv-lora 512, qk 128 + rope 64, v 128), a dense first layer, one shared
# expert of moe-ffn width, sigmoid scores with the expert bias, group-limited top-8 (8 groups,
# top 4), top-k scaling 2.5, sequence aux loss 1e-4, MTP 1; rows bf16 and <recipe> only (no
# peer builds these blocks), in $OUT/model_m_deepseek.jsonl:
#   DEEPSEEK=1 ROWS="bf16 blockwise tensorwise" bash benchmarks/moe_model_m.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/model_m}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-3}
LAYERS=8 HIDDEN=2048 HEADS=32 QGROUPS=4 EXPERTS=64 TOPK=8 FFN=768 SEQ=4096 MBS=2 VOCAB=32768
GBS=${GBS:-$MBS}  # sequences per optimizer step: GBS / MBS micro-batches accumulated, every row
if [ "${SMALL:-0}" = 1 ]; then HIDDEN=768 HEADS=12 FFN=256 SEQ=2048 VOCAB=50257; fi
if [ "${TINY:-0}" = 1 ]; then
  LAYERS=2 HIDDEN=64 HEADS=4 QGROUPS=2 EXPERTS=8 TOPK=2 FFN=32 SEQ=64 MBS=2 VOCAB=256
fi
MLA=(768 512 128 64 128) GROUPS_=8 GROUP_TOPK=4  # DEEPSEEK=1: q-lora, kv-lora, qk, rope, v
if [ "${DEEPSEEK:-0}" = 1 ]; then HEADS=16; fi
if [ "${DEEPSEEK:-0}${TINY:-0}" = 11 ]; then HEADS=4 MLA=(32 32 16 16 16) GROUPS_=4 GROUP_TOPK=2; fi
SHAPE=(--num-layers $LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS
  --num-experts $EXPERTS --moe-router-topk $TOPK --moe-ffn-hidden-size $FFN --seq-length $SEQ
  --micro-batch-size $MBS --vocab-size $VOCAB)
BLOCKS=(--num-query-groups $QGROUPS --group-query-attention --moe-router-load-balancing-type none)
ROWS_NAME=model_m
if [ "${DEEPSEEK:-0}" = 1 ]; then
  ROWS_NAME=model_m_deepseek
  BLOCKS=(
    --multi-latent-attention --q-lora-rank ${MLA[0]} --kv-lora-rank ${MLA[1]}
    --qk-head-dim ${MLA[2]} --qk-pos-emb-head-dim ${MLA[3]} --v-head-dim ${MLA[4]}
    --moe-layer-freq "([0]*1+[1]*$((LAYERS - 1)))" --moe-shared-expert-intermediate-size $FFN
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-num-groups $GROUPS_ --moe-router-group-topk $GROUP_TOPK
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4 --mtp-num-layers 1
  )
fi
MODEL_M=(
  "${SHAPE[@]}" "${BLOCKS[@]}" --ffn-hidden-size $((4 * HIDDEN))
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall
  --max-position-embeddings $SEQ --global-batch-size $GBS
  --mock-data --tokenizer-type NullTokenizer
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --bf16
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --init-model-with-meta-device --lr 1e-5 --clip-grad 1.0 --eval-iters 0 --log-interval 1
  --train-iters "$ITERS"
)
PEER=(--num-layers $LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS --num-query-groups $QGROUPS
  --num-experts $EXPERTS --moe-router-topk $TOPK --moe-ffn-hidden-size $FFN --seq-length $SEQ
  --micro-batch-size $MBS --global-batch-size $GBS --vocab-size $VOCAB --steps "$((ITERS - WARMUP))"
  --warmup-steps "$WARMUP")
[ "${TINY:-0}" = 1 ] || PEER+=(--compile)
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
fp8_row_flags() {  # <recipe>[_nofusion] -> the FP8 flags of that row
  local recipe=${1%_nofusion}
  FP8_FLAGS=(--fp8-recipe "$recipe" --fp8-format hybrid --fp8-param-gather)
  [ "$recipe" = "$1" ] || FP8_FLAGS+=(--no-gradient-accumulation-fusion)
}
if [ "${PRINT_ONLY:-0}" = 1 ]; then  # the pretrain_gpt.py flags of row $ROWS (bf16 or a recipe),
  # for a tool that runs them its own way (dev/moe_speed_lease.sh); nothing is run
  FP8_FLAGS=()
  [ "$ROWS" = bf16 ] || fp8_row_flags "$ROWS"
  echo "${MODEL_M[@]}" "${FP8_FLAGS[@]}"
  exit 0
fi
source benchmarks/rows.sh  # row, summarize
for name in ${ROWS:-fsdp2 torchao_rowwise bf16 tensorwise blockwise}; do
  case $name in
    fsdp2 | torchao_rowwise)
      if [ "${DEEPSEEK:-0}" = 1 ]; then
        echo "skip $name: the peer has no multi-latent attention, shared expert or MTP" | tee -a "$OUT/$ROWS_NAME.log"
        continue
      fi
      peer=("${PEER[@]}")
      [ "$name" = torchao_rowwise ] && peer+=(--torchao-fp8-rowwise)
      row "$name" torchrun --nproc-per-node 1 benchmarks/moe_peer.py "${peer[@]}"
      grep '^{' "$OUT/$name.log" | tee -a "$OUT/$ROWS_NAME.jsonl" ;;
    bf16)
      row bf16 torchrun --nproc-per-node 1 pretrain_gpt.py "${MODEL_M[@]}"
      summarize bf16 ;;
    *)
      fp8_row_flags "$name"
      row "$name" torchrun --nproc-per-node 1 pretrain_gpt.py "${MODEL_M[@]}" "${FP8_FLAGS[@]}"
      summarize "$name" ;;
  esac
done
