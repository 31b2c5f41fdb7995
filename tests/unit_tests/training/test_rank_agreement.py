"""A checkpoint file that is bad on one rank only stops every rank together, with the file
named, instead of leaving the healthy ranks to die (or hang) in the first collective."""

from __future__ import annotations

import os
import time

import pytest

from tests.launch import run_torchrun
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.mark.parametrize(
    "engine", [[], ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"]], ids=["ddp", "fsdp"]
)
def test_truncated_rng_file_of_rank_1_stops_both_ranks_naming_it(tmp_path, engine):
    save = tmp_path / "ckpt"
    base = ["pretrain_gpt.py", *TINY_GPT, *NO_DROPOUT, *engine, "--train-iters", "4"]
    status, _, stderr = run_torchrun(
        [*base, "--save", str(save), "--exit-interval", "2"], nproc=2, cwd=REPO, timeout_s=180
    )
    assert status == 0, stderr[-3000:]
    bad = save / "iter_0000002" / "rng" / "rank_00001.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    start = time.monotonic()
    status, stdout, stderr = run_torchrun(
        [*base, "--load", str(save)], nproc=2, cwd=REPO, timeout_s=180
    )
    assert time.monotonic() - start < 60  # both ranks exit; nobody waits in a collective
    # torchrun itself exits 1 for any failed rank; its report gives the ranks' own status.
    assert status == 1 and "failed (exitcode: 2)" in stderr, stderr[-3000:]
    errors = sorted(line for line in stderr.splitlines() if line.startswith("error: "))
    assert [line.split(":")[1] for line in errors] == [" rank 0", " rank 1"], stderr[-3000:]
    assert all(str(bad) in line for line in errors), errors
    assert "(on rank 1)" in errors[0] and "(on rank 1)" not in errors[1]
    assert "iteration        3/" not in stdout  # no rank trained past the load
    assert "Traceback" not in stderr.split("failed (exitcode")[0]
