#!/usr/bin/env bash
# Step time while an --async-save checkpoint is being written, against a run that saves nothing
# (issue 21: "within 10% of a step without one") and a synchronous save of the same state.
# Needs GPUs (CPU step times are dominated by the writer thread's share of 2 cores).
# Rows (ROWS to pick): nosave, async (--async-save), sync (the same saves, blocking).
# One JSON line per row in $OUT/async_save.jsonl:
#   step_ms            median logged step time of the steps with no write in flight
#   during_save_ms     median of the steps that ran while a write was in flight (async row)
#   steps_during_save  how many steps ran while a write was in flight
#   blocked_ms         the longest stop of training per save (async: queueing the copy to host
#                      memory, plus allocating its pinned buffers at the first save; sync: the
#                      whole write), from the log's "blocked training ... ms"
#   blocked_ms_per_save  that stop for every save, in order (the first one allocates the buffers)
#   after_save_ms      the step time of the iteration after each save, in order: its optimizer
#                      step waits on the GPU for the copy to host (async row)
# Default model: 545 M params (8 layers, hidden 2048, FFN 5632) with FP8 parameters, about
# 6.5 GB of fp32 main params + Adam moments per checkpoint; SAVE_INTERVAL 15 of ITERS 40 keeps
# three checkpoints on disk at a time under $OUT/ckpt_<row> (deleted after the row).
#   NPROC=1 ROWS="nosave async sync" bash benchmarks/async_save.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/async_save}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NPROC=${NPROC:-1}
ITERS=${ITERS:-40}
SAVE_INTERVAL=${SAVE_INTERVAL:-15}
WARMUP=${WARMUP:-3}
MODEL=(
  --num-layers "${LAYERS:-8}" --hidden-size "${HIDDEN:-2048}" --ffn-hidden-size "${FFN:-5632}"
  --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 2 --global-batch-size $((2 * NPROC))
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32768
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --bf16
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --fp8-recipe "${RECIPE:-tensorwise}" --fp8-param-gather
  --lr 1e-5 --eval-iters 0 --log-interval 1 --train-iters "$ITERS" --ckpt-format fsdp_dtensor
)
summarize() {  # row name: step times split by whether a write was in flight
  python3 - "$OUT/$1.log" "$1" "$WARMUP" <<'PY' | tee -a "$OUT/async_save.jsonl"
import json, re, statistics, sys
path, row, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
outside, during, blocked, after_save = [], [], [], []
in_flight = just_saved = False
for line in open(path):
    if "writing checkpoint of iteration" in line:
        in_flight = True
    elif "saved checkpoint at iteration" in line:
        in_flight = False
    stop = re.search(r"blocked training ([0-9.]+) ms", line)
    if stop:
        blocked.append(float(stop.group(1)))
        just_saved = True
    found = re.search(r"iteration +(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)", line)
    if found:
        if just_saved:
            after_save.append(float(found.group(2)))
            just_saved = False
        if int(found.group(1)) > warmup:
            (during if in_flight else outside).append(float(found.group(2)))
median = lambda values: round(statistics.median(values), 1) if values else None
print(json.dumps({"row": row, "step_ms": median(outside), "during_save_ms": median(during),
                  "steps_during_save": len(during), "blocked_ms": max(blocked, default=None),
                  "blocked_ms_per_save": blocked, "after_save_ms": after_save}))
PY
}
for name in ${ROWS:-nosave async sync}; do
  extra=()
  case $name in
    async) extra=(--save "$OUT/ckpt_$name" --save-interval "$SAVE_INTERVAL" --async-save) ;;
    sync) extra=(--save "$OUT/ckpt_$name" --save-interval "$SAVE_INTERVAL") ;;
  esac
  echo "== $name" | tee -a "$OUT/async_save.log"
  timeout "${RUN_TIMEOUT:-540}" torchrun --nproc-per-node "$NPROC" pretrain_gpt.py "${MODEL[@]}" \
    "${extra[@]}" > "$OUT/$name.log" 2>&1
  echo "exit $? ($name)" | tee -a "$OUT/async_save.log"
  summarize "$name"
  rm -rf "$OUT/ckpt_$name"
done
