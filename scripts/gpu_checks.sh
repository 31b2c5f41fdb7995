#!/usr/bin/env bash
# One batched GPU session (H200): GPU unit tests, FP8 kernel check + benchmark, and a short
# training smoke test per recipe. Writes logs under $OUT (or /tmp/gpu_checks).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
timeout 300 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/unit_tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
timeout 280 python3 benchmarks/bench_fp8.py --check 2>&1 | tee "$OUT/bench_fp8.txt" | tail -30
