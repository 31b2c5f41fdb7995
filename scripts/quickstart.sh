#!/usr/bin/env bash
# The README's train command: installs what is needed, turns the Python standard library's
# source files into a byte-level corpus (once, cached), and trains a small GPT on CPU.
# Extra arguments are passed to pretrain_gpt.py (e.g. --fp8-recipe tensorwise, --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_EXTRAS=${MEGATRON_EXTRAS:-progress} bash scripts/setup_env.sh
PYTHON=${PYTHON:-python3}
PREFIX=$("$PYTHON" scripts/prepare_quickstart_data.py | tail -n 1)
OUTPUT_DIR=${OUTPUT_DIR:-runs/quickstart}
mkdir -p "$OUTPUT_DIR"
exec "$PYTHON" pretrain_gpt.py \
  --data-path "$PREFIX" --tokenizer-type ByteTokenizer --split 98,2,0 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
  --ffn-hidden-size 352 --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 16 --global-batch-size 32 --train-iters 300 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 \
  --clip-grad 1.0 --log-interval 20 --eval-interval 100 --eval-iters 4 --seed 1234 \
  --save "$OUTPUT_DIR/checkpoints" \
  "$@"
