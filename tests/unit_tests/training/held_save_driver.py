"""pretrain_gpt.py with a fault injected into --async-save, for test_async_save.py:
`held_save_driver.py ITERATION <pretrain flags>`. Each rank's writer of that iteration stops
for good once its shards are written (the .tmp then holds shards but no RNG files or
metadata.json), after writing `<tmp>/held_by_rank_<r>` with its pid, so that the test can kill
a rank mid-save deterministically."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, under torchrun

from megatron.training.training import pretrain  # noqa: E402


def main() -> None:
    held_iteration = int(sys.argv[1])
    rank = os.environ.get("RANK", "0")

    def hold(tmp: str, iteration: int) -> None:
        if iteration != held_iteration:
            return
        marker = os.path.join(tmp, f"held_by_rank_{rank}")
        with open(marker + ".part", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(marker + ".part", marker)
        threading.Event().wait()

    pretrain(sys.argv[2:], destroy_process_group=False, save_fault=hold)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as pretrain_gpt.py: no interpreter teardown after a multi-rank CPU run


if __name__ == "__main__":
    main()
