# Sourced by setup_env.sh, quickstart.sh and run_tests.sh (from the checkout's root): sets and
# exports PYTHON, the interpreter they install into and run.
#
# By default that is a virtual environment in the checkout, .venv/ (created on first use, about
# 10 s), so the install never changes the system's python3. It sees the system's packages
# (--system-site-packages): a torch that is already installed, e.g. a CUDA build, is reused
# rather than downloaded again. Opt out: an active virtual environment ($VIRTUAL_ENV) is used
# as it is; PYTHON=... names an interpreter; MEGATRON_NO_VENV=1 uses python3 itself.
if [[ -z ${PYTHON:-} ]]; then
  if [[ -n ${VIRTUAL_ENV:-} || ${MEGATRON_NO_VENV:-0} == 1 ]]; then
    PYTHON=python3
  else
    if [[ ! -x .venv/bin/python ]]; then
      echo "setup_env: creating a virtual environment in .venv/ (MEGATRON_NO_VENV=1: no venv)"
      python3 -m venv --system-site-packages .venv
    fi
    PYTHON=$PWD/.venv/bin/python
    # As `source .venv/bin/activate` would: the venv's console scripts (torchrun, ruff) come
    # first, for the tests and benchmark scripts that launch them.
    export PATH=$PWD/.venv/bin:$PATH
  fi
fi
export PYTHON
