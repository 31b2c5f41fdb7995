#!/usr/bin/env bash
# One device call of MoE speed questions (issue 38), results under $OUT (at most 8 files back):
#   1. torch.profiler trace of model M-small (PROFILE_SMALL=0: model M), steps 5-6, of each row
#      of PROFILE_ROWS (default tensorwise; GBS=16 profiles 8 micro-batches a step):
#      $OUT/gpu_<row>.txt (GPU time by kernel), $OUT/cpu_<row>.txt (host time by op);
#   2. benchmarks/bench_grouped_gemm.py at model M's expert shape (hidden 2048, ffn 768):
#      $OUT/gg_model_m.jsonl;
#   3. the grouped CUDA tests (-m gpu: test_grouped_gemm.py, test_grouped_fp8.py, then
#      test_grouped_fp8_blockwise_params.py);
#   4. dev/bench_transpose_bytes.py (byte transposes against torch and a copy): $OUT/transpose.jsonl;
#   5. dev/host_sampler.py --sync-debug on model M-small (HOST_SMALL=0: model M; ROWS: tensorwise bf16):
#      $OUT/host_<row>.txt;
#   6. model M-small's rows (benchmarks/moe_model_m.sh SMALL=1, ROWS: bf16 tensorwise
#      blockwise): $OUT/model_m.jsonl;
#   7. model M's rows with the peers (ROWS_M, default fsdp2 torchao_rowwise bf16 tensorwise
#      blockwise; torchao from the wheel in .whl/, carried): $OUT/model_m.jsonl;
#   8. what is alive at model M's peak (MEM_ROWS, default bf16 tensorwise: 5 steps with
#      --record-memory-history, dev/peak_memory_breakdown.py): $OUT/peak_<row>.txt;
#   9. host against GPU time of one layer's experts and of each FP8 piece at model M's shape
#      (dev/bench_grouped_host.py): $OUT/host_cost.jsonl.
# Each part has its own time limit; STEPS="1 2 3" picks parts (default 1-6). Run from the repository root:
#   bash dev/moe_speed_lease.sh            (device: OUT is set; elsewhere OUT=/tmp/lease)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lease}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for step in ${STEPS:-1 2 3 4 5 6}; do
  case $step in
    1)
      # Megatron-LM's trace folder: torch_profile/ beside --tensorboard-dir (needs tensorboard).
      python3 -c "import torch.utils.tensorboard" || { echo "no tensorboard: no profile"; continue; }
      for row in ${PROFILE_ROWS:-tensorwise}; do
        # The row's flags (benchmarks/moe_model_m.sh SMALL=1 unless PROFILE_SMALL=0), printed.
        flags=$(OUT=/tmp/lease_rows SMALL=${PROFILE_SMALL:-1} ITERS=7 PRINT_ONLY=1 ROWS=$row bash benchmarks/moe_model_m.sh)
        rm -rf /tmp/lease_prof
        timeout "${PROFILE_TIMEOUT:-130}" torchrun --nproc-per-node 1 pretrain_gpt.py $flags \
          --tensorboard-dir /tmp/lease_prof/tb --profile --use-pytorch-profiler \
          --profile-step-start 5 --profile-step-end 7 > /tmp/lease_prof.log 2>&1
        echo "profile $row rc $?"; grep "elapsed time per" /tmp/lease_prof.log | tail -3 | cut -c1-160
        trace=$(ls /tmp/lease_prof/torch_profile/*.json.gz | head -1)
        python3 dev/trace_summary.py "$trace" --top 60 > "$OUT/gpu_$row.txt"
        python3 dev/trace_summary.py "$trace" --top 70 --cpu > "$OUT/cpu_$row.txt"
        head -12 "$OUT/gpu_$row.txt"; head -3 "$OUT/cpu_$row.txt"
      done ;;
    2)
      timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_grouped_gemm.py --ffn 768 \
        --out "$OUT/gg_model_m.jsonl" 2>&1 | tail -25 ;;
    3)
      for file in fp8/test_grouped_gemm.py models/moe/test_grouped_fp8.py \
        models/moe/test_grouped_fp8_blockwise_params.py; do
        timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu \
          "tests/unit_tests/$file" --tb=short 2>&1 | tail -6
      done ;;
    4)
      timeout "${BENCH_TIMEOUT:-150}" python3 dev/bench_transpose_bytes.py \
        --out "$OUT/transpose.jsonl" 2>&1 | tail -40 ;;
    5)
      for row in ${ROWS:-tensorwise bf16}; do
        flags=$(OUT=/tmp/lease_rows SMALL=${HOST_SMALL:-1} PRINT_ONLY=1 ROWS=$row bash benchmarks/moe_model_m.sh)
        timeout "${PROFILE_TIMEOUT:-130}" python3 dev/host_sampler.py --skip-iters 10 --top 45 --sync-debug \
          -- pretrain_gpt.py $flags > "$OUT/host_$row.txt" 2>&1
        echo "sampler $row rc $?"; grep "elapsed time per" "$OUT/host_$row.txt" | tail -2 | cut -c1-150
      done ;;
    6)
      OUT=$OUT SMALL=1 ITERS=${ITERS:-12} WARMUP=4 RUN_TIMEOUT=${RUN_TIMEOUT:-90} \
        ROWS=${SMALL_ROWS:-bf16 tensorwise blockwise} bash benchmarks/moe_model_m.sh 2>&1 | tail -5 ;;
    7)
      pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl 2>&1 | tail -2
      PYTHONPATH=/tmp/site OUT=$OUT ITERS=${ITERS:-12} WARMUP=4 RUN_TIMEOUT=${RUN_TIMEOUT:-110} \
        ROWS=${ROWS_M:-fsdp2 torchao_rowwise bf16 tensorwise blockwise} \
        bash benchmarks/moe_model_m.sh 2>&1 | tail -8 ;;
    8)
      for row in ${MEM_ROWS:-bf16 tensorwise}; do
        flags=$(OUT=/tmp/lease_rows SMALL=0 ITERS=5 PRINT_ONLY=1 ROWS=$row bash benchmarks/moe_model_m.sh)
        timeout "${PROFILE_TIMEOUT:-130}" torchrun --nproc-per-node 1 pretrain_gpt.py $flags \
          --record-memory-history --memory-snapshot-path /tmp/lease_mem_$row.pickle > /tmp/lease_mem.log 2>&1
        echo "memory $row rc $?"; grep "elapsed time per" /tmp/lease_mem.log | tail -1 | cut -c1-150
        snapshot=$(ls /tmp/lease_mem_${row}*.pickle | tail -1)
        python3 dev/peak_memory_breakdown.py "$snapshot" --top 30 > "$OUT/peak_$row.txt"
        head -14 "$OUT/peak_$row.txt"
      done ;;
    9)
      timeout "${BENCH_TIMEOUT:-150}" python3 dev/bench_grouped_host.py \
        --out "$OUT/host_cost.jsonl" 2>&1 | tail -12 ;;
  esac
done
