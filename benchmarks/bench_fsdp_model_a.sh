#!/usr/bin/env bash
# Model A of docs/PERFORMANCE.md on all local GPUs: FSDP2 bf16 vs Megatron-FSDP bf16 (ZeRO-3), each
# with and without torch.compile, in one job. One JSON line per run in $OUT/bench_gpt.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NPROC=${NPROC:-$(nvidia-smi -L | grep -c '^GPU')}
for engine in ${ENGINES:-fsdp2 megatron-fsdp}; do
  for mode in ${COMPILE_MODES:-eager compile}; do
    compile=""
    [ "$mode" = compile ] && compile="--compile"
    echo "== $engine $mode" | tee -a "$OUT/bench_gpt.log"
    timeout "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node "$NPROC" benchmarks/bench_gpt.py \
      --engine "$engine" $compile ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench_gpt.log" \
      | grep '^{' >> "$OUT/bench_gpt.jsonl"
  done
done
cat "$OUT/bench_gpt.jsonl"
