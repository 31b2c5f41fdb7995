"""Stand-in for pretrain_gpt.py in launcher tests: joins the process group the way
pretrain_gpt.py does (torchrun-style env vars, gloo on CPU), all-reduces rank + 1 and prints
one line per rank that the tests parse:

    probe rank=R world=W local_rank=L master=ADDR:PORT sum=S argv=["..."]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    contribution = torch.tensor([float(rank + 1)])
    dist.all_reduce(contribution)
    dist.destroy_process_group()
    line = (
        f"probe rank={rank} world={world_size} local_rank={local_rank} master={master} "
        f"sum={contribution.item():g} argv={json.dumps(sys.argv[1:])}\n"
    )
    # One write(2) of a short line on a shared pipe is atomic, so the ranks' lines never
    # interleave (print's separate writes of text and newline could).
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


if __name__ == "__main__":
    main()
