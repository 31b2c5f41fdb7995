#!/usr/bin/env bash
# Model A (docs/PERFORMANCE.md) at DP=$NPROC (default 1) on one host, every row in one job: the
# FSDP2 bf16 peer (compiled, fused AdamW, clip 1.0) from benchmarks/bench_gpt.py, then pretrain_gpt.py
# with Megatron-FSDP (ZeRO-3) in bf16 and with FP8 parameters for each recipe, on the command line a
# Megatron-LM user brings: no --torch-compile (compiled by default on CUDA since issue 37);
# torchao_tensorwise / torchao_rowwise: the torchao float8 peer rows (FSDP2, compiled).
# <recipe>_keepcopy: that recipe with --no-fp8-wgrad-input-from-activation (fc2 keeps an FP8 copy
# of its input from forward, as before 2026-12-02e), e.g. tensorwise_keepcopy. <recipe>_amaxpass:
# compiled tensorwise with its own amax pass, not max|x| fused into the producer (as before
# docs/benchmarks/tensorwise_producer_amax_h200_2026-12-03.md). <recipe>_eager: --no-torch-compile.
# <recipe>_bf16moments: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16.
# <recipe>_nofusion: --no-gradient-accumulation-fusion (FP8 wgrads as bf16 plus a cast pass).
# <recipe>_fp8stats: --log-fp8-stats every FP8STATS_INTERVAL (default 100) iterations; its cost
# is in mean_ms (the median hides the one statistics step), so give ITERS >= 2 intervals, e.g.
#   ITERS=300 ROWS="tensorwise tensorwise_fp8stats" bash benchmarks/model_a_dp1.sh
# One JSON line per row in $OUT/model_a_dp1.jsonl: step_ms is the median of the logged
# iteration times after the first WARMUP iterations (compile and allocator warm-up).
#   ROWS="fsdp2 bf16 tensorwise" ITERS=20 bash benchmarks/model_a_dp1.sh
# MEMORY_SNAPSHOT=1: the pretrain_gpt.py rows also record CUDA allocations (rank 0) and write
# $OUT/<row>_memory.txt, the live set at the peak by allocating line (dev/peak_memory_breakdown.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/model_a}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ITERS=${ITERS:-20}
NPROC=${NPROC:-1}  # GPUs (data-parallel ranks); Model A's micro-batch 2 on each
WARMUP=${WARMUP:-3}
# GBS: the pretrain_gpt.py rows' global batch, GBS / (2 x NPROC) micro-batches per optimizer step
# (the fusion's later micro-batches, e.g. GBS=16 ROWS="tensorwise tensorwise_nofusion"); the
# bench_gpt.py rows (fsdp2, torchao_*, bench_*) run one micro-batch a step: skipped at any other GBS.
GBS=${GBS:-$((2 * NPROC))}
MODEL_A=(
  --num-layers 8 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size $GBS
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32768
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --bf16
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --init-model-with-meta-device --lr 1e-5 --clip-grad 1.0 --eval-iters 0 --log-interval 1
  --train-iters "$ITERS"
)
ROWS_NAME=model_a_dp1
source benchmarks/rows.sh  # row, summarize
snapshot_args() {  # name: the memory-history flags when MEMORY_SNAPSHOT=1
  [ "${MEMORY_SNAPSHOT:-0}" = 1 ] && echo --record-memory-history --memory-snapshot-path "$OUT/$1.pickle"
}
breakdown() {  # name: the live set at the peak of rank 0's snapshot
  [ "${MEMORY_SNAPSHOT:-0}" = 1 ] || return 0
  python3 dev/peak_memory_breakdown.py "$OUT/${1}_0.pickle" --top 40 > "$OUT/${1}_memory.txt" 2>&1
  head -15 "$OUT/${1}_memory.txt"
}
fp8_row() {  # name, recipe, then more pretrain_gpt.py flags: one of our FP8-parameter rows
  local name=$1 recipe=$2; shift 2
  row "$name" torchrun --nproc-per-node "$NPROC" pretrain_gpt.py "${MODEL_A[@]}" \
    --fp8-recipe "$recipe" --fp8-format hybrid --fp8-param-gather "$@" $(snapshot_args "$name")
  summarize "$name"; breakdown "$name"
}
for name in ${ROWS:-fsdp2 torchao_tensorwise torchao_rowwise bf16 tensorwise delayed blockwise mxfp8 bench_bf16 bench_tensorwise}; do
  if [ "$GBS" != $((2 * NPROC)) ] && [[ $name == fsdp2 || $name == torchao_* || $name == bench_* ]]; then
    echo "skip $name: bench_gpt.py runs one micro-batch a step, GBS=$GBS asks for accumulation" | tee -a "$OUT/model_a_dp1.log"
    continue
  fi
  case $name in
    fsdp2)
      row fsdp2 torchrun --nproc-per-node "$NPROC" benchmarks/bench_gpt.py --engine fsdp2 --compile
      grep '^{' "$OUT/fsdp2.log" | tee -a "$OUT/model_a_dp1.jsonl" ;;
    torchao_*)  # the torchao float8 peer under FSDP2 (needs torchao importable)
      row "$name" torchrun --nproc-per-node "$NPROC" benchmarks/bench_gpt.py --engine fsdp2 --compile \
        --torchao-float8 "${name#torchao_}"
      grep '^{' "$OUT/$name.log" | tee -a "$OUT/model_a_dp1.jsonl" ;;
    bench_bf16)
      row "$name" torchrun --nproc-per-node "$NPROC" benchmarks/bench_gpt.py --engine megatron-fsdp --compile
      grep '^{' "$OUT/$name.log" | tee -a "$OUT/model_a_dp1.jsonl" ;;
    bench_*)
      row "$name" torchrun --nproc-per-node "$NPROC" benchmarks/bench_gpt.py --engine megatron-fsdp \
        --compile --fp8-recipe "${name#bench_}" --fp8-param-gather
      grep '^{' "$OUT/$name.log" | tee -a "$OUT/model_a_dp1.jsonl" ;;
    bf16)
      row bf16 torchrun --nproc-per-node "$NPROC" pretrain_gpt.py "${MODEL_A[@]}" $(snapshot_args bf16)
      summarize bf16; breakdown bf16 ;;
    *_eager)
      fp8_row "$name" "${name%_eager}" --no-torch-compile ;;
    *_bf16moments)
      fp8_row "$name" "${name%_bf16moments}" --use-precision-aware-optimizer --exp-avg-dtype bf16 \
        --exp-avg-sq-dtype bf16 ;;
    *_fp8stats)  # the recipe with the FP8 statistics on (issue 41)
      fp8_row "$name" "${name%_fp8stats}" --log-fp8-stats --log-fp8-stats-interval "${FP8STATS_INTERVAL:-100}" ;;
    *_nofusion)  # the recipe with --no-gradient-accumulation-fusion (bf16 wgrad + cast pass)
      fp8_row "$name" "${name%_nofusion}" --no-gradient-accumulation-fusion ;;
    *_keepcopy)  # the recipe with --no-fp8-wgrad-input-from-activation
      fp8_row "$name" "${name%_keepcopy}" --no-fp8-wgrad-input-from-activation ;;
    *_amaxpass)  # the recipe with fp8.debug amax_in_graph off (dev/amax_pass/sitecustomize.py)
      PYTHONPATH=$PWD/dev/amax_pass:$PYTHONPATH fp8_row "$name" "${name%_amaxpass}" ;;
    *)
      fp8_row "$name" "$name" ;;
  esac
done
