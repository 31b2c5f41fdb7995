#!/usr/bin/env bash
# Installs what megatron-fp8 needs on a fresh machine, then the package itself (editable), into
# the checkout's .venv/ unless a virtual environment is active (scripts/python_env.sh says how
# to opt out).
# torch is installed explicitly first: on the CPU machines torch==2.13.0 is a local CPU build,
# while an unpinned "torch" would pull a multi-GB CUDA build. An existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "setup_env: installing torch==${TORCH_VERSION:-2.13.0} (pip shows its progress)"
  "$PYTHON" -m pip install "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=${MEGATRON_EXTRAS:-test}
# Already set up (this checkout installed, its deps and extras importable)? Then skip pip.
# The check runs from / so that the source tree itself cannot stand in for an installed package.
check_modules="megatron,numpy"
if [ "$extras" = "test" ]; then
  check_modules="$check_modules,pytest,pytest_timeout,xdist,ruff,yaml,tensorboard,wandb,tokenizers,tiktoken,sentencepiece,tqdm,transformers,safetensors,matplotlib"
fi
repo=$PWD
if (cd / && "$PYTHON" - "$check_modules" "$repo" <<'PY') >/dev/null 2>&1
import importlib, importlib.metadata, os, sys
importlib.metadata.version("megatron-fp8")
for name in sys.argv[1].split(","):
    importlib.import_module(name)
import megatron
assert os.path.dirname(os.path.dirname(os.path.abspath(megatron.__file__))) == sys.argv[2]
PY
then
  exit 0
fi
echo "setup_env: installing megatron-fp8 (editable) and its extras [${extras}] with pip (30-60 s) ..."
"$PYTHON" -m pip install --quiet --no-build-isolation -e ".[${extras}]" 2>/dev/null \
  || "$PYTHON" -m pip install --quiet -e ".[${extras}]"
echo "setup_env: installed"
