"""Pretrain a GPT with megatron-fp8. Launch with python, torchrun or Slurm; see --help."""

import os
import sys

from megatron.training.training import NonFiniteTrainingError, pretrain

if __name__ == "__main__":
    try:
        pretrain(destroy_process_group=False)
    except NonFiniteTrainingError as error:
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank}: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    # Leave without interpreter teardown. After a completed multi-rank CPU run, gloo's worker
    # threads could still be joinable while static destructors ran, which intermittently aborted
    # a finished run ("terminate called without an active exception", exit -6). By now every
    # checkpoint and log is written and closed, and every rank has passed the final barrier;
    # the process group goes with the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
