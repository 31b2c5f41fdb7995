#!/usr/bin/env bash
# The GPU checks (H200), in two parts that each fit one 10-minute device call on a fresh machine
# (most of the time goes to compiling each test's Triton kernels there):
#   PART=1: the FP8 kernel and Linear tests (fp8/test_cuda_*, test_compile, test_piece_quantize,
#           test_wgrad_input_from_activation) and distributed/test_grad_copy;
#   PART=2: every other GPU test (optimizer, training, models), then bench_fp8.py --check and its
#           kernel and Linear timings.
#   PART=all (default): both, one after the other.
# Writes logs under $OUT (or /tmp/gpu_checks); the slowest tests are listed at the end of each log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
PART=${PART:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
KERNEL_TESTS=(tests/unit_tests/fp8/test_cuda_gemm.py tests/unit_tests/fp8/test_cuda_linear.py
  tests/unit_tests/fp8/test_cuda_quantize.py tests/unit_tests/fp8/test_compile.py
  tests/unit_tests/fp8/test_piece_quantize.py tests/unit_tests/fp8/test_wgrad_input_from_activation.py
  tests/unit_tests/distributed/test_grad_copy.py)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
gpu_pytest() {  # log name, then pytest arguments
  local name=$1; shift
  timeout "${PYTEST_TIMEOUT:-520}" python3 -m pytest -q -m gpu -rfs --durations=10 -p no:cacheprovider "$@" \
    > "$OUT/$name.txt" 2>&1
  echo "exit $? ($name)" | tee -a "$OUT/$name.txt"
  grep -E "passed|failed|error" "$OUT/$name.txt" | tail -3
}
if [ "$PART" = 1 ] || [ "$PART" = all ]; then
  gpu_pytest gpu_tests_kernels "${KERNEL_TESTS[@]}"
fi
if [ "$PART" = 2 ] || [ "$PART" = all ]; then
  deselect=()
  for f in "${KERNEL_TESTS[@]}"; do deselect+=(--ignore "$f"); done
  gpu_pytest gpu_tests_rest tests/unit_tests "${deselect[@]}"
  timeout 280 python3 benchmarks/bench_fp8.py --check 2>&1 | tee "$OUT/bench_fp8.txt" | tail -30
fi
