#!/usr/bin/env bash
# FP8 vs high precision on the quickstart model: the same seed, data and schedule for the
# high-precision run (labelled bf16; its params are fp32 unless --bf16 is passed, since bf16
# matmuls are very slow on CPU) and each recipe; prints final losses and their ratio.
# Usage: bash benchmarks/fp8_convergence.sh [ITERS] [extra pretrain_gpt.py flags for every run]
#   FP8_FLAGS="--fp8-param-gather" adds flags to the FP8 runs only, e.g. FP8 parameters in
#   Megatron-FSDP: FP8_FLAGS=--fp8-param-gather bash benchmarks/fp8_convergence.sh 300 --use-megatron-fsdp
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${1:-200}
shift || true
OUT=${OUT:-runs/fp8_convergence}
mkdir -p "$OUT"
for recipe in bf16 tensorwise delayed blockwise mxfp8; do
  flags=()
  [ "$recipe" != bf16 ] && flags=(--fp8-recipe "$recipe" ${FP8_FLAGS:-})
  rm -rf "${OUT:?}/$recipe"  # a fresh run each time (quickstart.sh refuses to train over one)
  OUTPUT_DIR="$OUT" RUN_NAME="$recipe" bash scripts/quickstart.sh --train-iters "$ITERS" \
    --lr-warmup-iters $((ITERS / 10)) --eval-interval "$ITERS" --log-interval 10 \
    "${flags[@]}" "$@" > "$OUT/$recipe.log" 2>&1
done
python3 - "$OUT" <<'PY'
import re, sys, os
out = sys.argv[1]
def last(pattern, text):
    found = re.findall(pattern, text)
    return float(found[-1]) if found else float("nan")
rows = {}
for recipe in ["bf16", "tensorwise", "delayed", "blockwise", "mxfp8"]:
    text = open(os.path.join(out, f"{recipe}.log")).read()
    rows[recipe] = (last(r"lm loss: ([0-9.E+-]+)", text), last(r"lm loss value: ([0-9.E+-]+)", text))
base_train, base_valid = rows["bf16"]
print("recipe      train loss  valid loss  valid/bf16")
for recipe, (train, valid) in rows.items():
    print(f"{recipe:10s}  {train:10.4f}  {valid:10.4f}  {valid / base_valid:10.4f}")
PY
