#!/usr/bin/env bash
# Creates the megatron-core 0.16.1 reference venv that tests/unit_tests/ecosystem/
# test_checkpoint_convert.py checks our Megatron-LM import and export against (it skips, saying
# so, where the venv is missing). A venv of its own because its `megatron` package would shadow
# ours. torch is installed first (a CPU build, as scripts/setup_env.sh does), then megatron-core.
# Usage: MCORE_VENV=DIR bash scripts/setup_mcore_venv.sh   (default DIR: .venv-mcore here)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MCORE_VENV:-$PWD/.venv-mcore}
PYTHON=${PYTHON:-python3}
# Already there? The check runs from / so that this checkout's megatron/ cannot answer it.
if (cd / && "$venv/bin/python" -c "import megatron.core, importlib.metadata as m; \
    assert m.version('megatron-core') == '0.16.1'") >/dev/null 2>&1; then
  exit 0
fi
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
"$venv/bin/python" -m pip install --quiet "megatron-core==0.16.1"
if ! (cd / && PYTHONWARNINGS=ignore "$venv/bin/python" -c "import megatron.core.models.gpt"); then
  echo "ERROR: megatron-core does not import in $venv" >&2
  exit 1
fi
echo "megatron-core 0.16.1 reference venv ready at $venv"
