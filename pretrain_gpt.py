"""Pretrain a GPT with megatron-fp8. Launch with python, torchrun or Slurm; see --help."""

import os
import sys

from megatron.training.training import pretrain

if __name__ == "__main__":
    pretrain()
    # Leave without interpreter teardown. After a completed multi-rank CPU run, gloo's worker
    # threads could still be joinable while static destructors ran, which intermittently aborted
    # a finished run ("terminate called without an active exception", exit -6). By now every
    # checkpoint and log is written and closed, and the process group is destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
