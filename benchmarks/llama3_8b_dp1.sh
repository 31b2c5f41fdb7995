#!/usr/bin/env bash
# The Llama-3-8B shape (32 layers, hidden 4096, FFN 14336, 32 heads, 8 query groups, vocab 128256,
# sequence 8192, micro-batch 1) at DP=1 on one GPU, FP8 tensorwise parameters, every row in one job:
#   full_recompute: fp32 moments with --recompute-granularity full (the 2026-12-04 baseline)
#   bf16moments: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16, no recompute
#   bf16moments_selective: the same with --recompute-granularity selective
#   offload<F>: bf16 moments and --optimizer-cpu-offload --optimizer-offload-fraction 0.<F>
#   fsdp2: the compiled FSDP2 bf16 peer from benchmarks/bench_gpt.py on the same model
# One JSON line per row in $OUT/llama3_8b_dp1.jsonl (step_ms: median after WARMUP iterations).
#   ROWS="bf16moments fsdp2" ITERS=10 bash benchmarks/llama3_8b_dp1.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llama3_8b}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-3}
SHAPE=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --num-query-groups 8 --vocab-size 128256 --seq-length 8192 --micro-batch-size 1)
LLAMA=("${SHAPE[@]}" --group-query-attention --max-position-embeddings 8192 --global-batch-size 1
  --mock-data --tokenizer-type NullTokenizer
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --bf16
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --init-model-with-meta-device --lr 1e-5 --clip-grad 1.0 --eval-iters 0 --log-interval 1
  --train-iters "$ITERS" --fp8-recipe tensorwise --fp8-format hybrid --fp8-param-gather)
BF16_MOMENTS=(--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)
row() {  # name, then pretrain_gpt.py's extra flags
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/llama3_8b_dp1.log"
  timeout "${RUN_TIMEOUT:-300}" torchrun --nproc-per-node 1 pretrain_gpt.py "${LLAMA[@]}" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "exit $? ($name)" | tee -a "$OUT/llama3_8b_dp1.log"
  python3 - "$OUT/$name.log" "$name" "$WARMUP" <<'PY' | tee -a "$OUT/llama3_8b_dp1.jsonl"
import json, re, statistics, sys
text = open(sys.argv[1]).read()
times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
mem = [float(m) for m in re.findall(r"max allocated: ([0-9.]+)", text)]
steady = times[int(sys.argv[3]):]
ms = statistics.median(steady) if steady else None
print(json.dumps({"row": sys.argv[2], "step_ms": round(ms, 1) if ms else None, "steps": len(steady),
                  "tokens_per_s": round(8192 / (ms / 1e3)) if ms else None,
                  "peak_mem_gib": max(mem) if mem else None, "oom": "OutOfMemoryError" in text}))
PY
}
for name in ${ROWS:-bf16moments full_recompute}; do
  case $name in
    full_recompute) row "$name" --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 ;;
    bf16moments) row "$name" "${BF16_MOMENTS[@]}" ;;
    bf16moments_selective) row "$name" "${BF16_MOMENTS[@]}" --recompute-granularity selective ;;
    offload*) row "$name" "${BF16_MOMENTS[@]}" --optimizer-cpu-offload --optimizer-offload-fraction "0.${name#offload}" ;;
    fsdp2)
      echo "== fsdp2" | tee -a "$OUT/llama3_8b_dp1.log"
      timeout "${RUN_TIMEOUT:-300}" torchrun --nproc-per-node 1 benchmarks/bench_gpt.py --engine fsdp2 \
        --compile "${SHAPE[@]}" --steps 5 --warmup-steps 2 > "$OUT/fsdp2.log" 2>&1
      echo "exit $? (fsdp2)" | tee -a "$OUT/llama3_8b_dp1.log"
      grep '^{' "$OUT/fsdp2.log" | tee -a "$OUT/llama3_8b_dp1.jsonl"
      grep -q OutOfMemoryError "$OUT/fsdp2.log" && echo '{"row": "fsdp2", "oom": true}' | tee -a "$OUT/llama3_8b_dp1.jsonl" ;;
  esac
done
