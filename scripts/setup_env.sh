#!/usr/bin/env bash
# Installs what megatron-fp8 needs on a fresh machine, then the package itself (editable).
# torch is installed explicitly first: on the CPU machines torch==2.13.0 is a local CPU build,
# while an unpinned "torch" would pull a multi-GB CUDA build. An existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=${MEGATRON_EXTRAS:-test}
# Already set up (this checkout installed, extras importable)? Then skip pip entirely.
check_modules="megatron"
if [ "$extras" = "test" ]; then
  check_modules="megatron,pytest,pytest_timeout,ruff,yaml,tensorboard,wandb,tokenizers,tqdm,transformers,safetensors,matplotlib"
fi
if "$PYTHON" - "$check_modules" "$PWD" <<'PY' >/dev/null 2>&1
import importlib, os, sys
for name in sys.argv[1].split(","):
    module = importlib.import_module(name)
import megatron
assert os.path.dirname(os.path.dirname(os.path.abspath(megatron.__file__))) == sys.argv[2]
PY
then
  exit 0
fi
"$PYTHON" -m pip install --quiet --no-build-isolation -e ".[${extras}]" 2>/dev/null \
  || "$PYTHON" -m pip install --quiet -e ".[${extras}]"
