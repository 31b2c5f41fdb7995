"""Pretrain a GPT with megatron-fp8. Launch with python, torchrun or Slurm; see --help."""

import os
import sys

from megatron.training.training import pretrain

if __name__ == "__main__":
    pretrain(destroy_process_group=False)
    # Leave without interpreter teardown. After a completed multi-rank CPU run, gloo's worker
    # threads could still be joinable while static destructors ran, which intermittently aborted
    # a finished run ("terminate called without an active exception", exit -6). By now every
    # checkpoint and log is written and closed, and every rank has passed the final barrier;
    # the process group goes with the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
