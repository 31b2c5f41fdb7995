"""Pretrain a GPT with megatron-fp8. Launch with python, torchrun or Slurm; see --help."""

import os
import sys

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.environment import get_env
from megatron.training.checkpoint import CheckpointSaveError
from megatron.training.training import DataError, NonFiniteTrainingError, pretrain

# One `error:` line per rank instead of a traceback: status 2 for what a --load path or the
# data flags caused, 1 for a failed save or a run stopped by --check-for-nan-in-loss-and-grad.
# MEGATRON_TRACEBACK=1 re-raises instead.
USER_ERRORS = {
    CheckpointError: 2,
    DataError: 2,
    CheckpointSaveError: 1,
    NonFiniteTrainingError: 1,
}

if __name__ == "__main__":
    try:
        pretrain(destroy_process_group=False)
    except tuple(USER_ERRORS) as error:
        if get_env("MEGATRON_TRACEBACK") == "1":
            raise
        rank = get_env("RANK", "0")
        sys.stdout.flush()
        sys.stderr.flush()
        # One write per line: ranks share the launcher's stderr pipe, and print's separate
        # newline write let two ranks' lines run together (seen under torchrun).
        os.write(2, f"error: rank {rank}: {error}\n".encode())
        os._exit(next(code for kind, code in USER_ERRORS.items() if isinstance(error, kind)))
    # Leave without interpreter teardown. After a completed multi-rank CPU run, gloo's worker
    # threads could still be joinable while static destructors ran, which intermittently aborted
    # a finished run ("terminate called without an active exception", exit -6). By now every
    # checkpoint and log is written and closed, and every rank has passed the final barrier;
    # the process group goes with the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
