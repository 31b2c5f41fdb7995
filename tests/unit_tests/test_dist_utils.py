"""tests/unit_tests/dist_utils.run_distributed forks its ranks from a fork server started once:
each rank still sees what a freshly spawned one would at the call (the caller's environment,
working directory and stdout/stderr, here pytest's capture of this test), and is a process of
its own."""

from __future__ import annotations

import os

from tests.unit_tests.dist_utils import run_distributed

MARK = "H32_DIST_UTILS_MARK"


def _what_the_rank_sees(rank: int, world_size: int) -> dict:
    # One write per line: under PYTHONUNBUFFERED (set on CI machines) print() makes two, the
    # text and the newline, and the two ranks' writes to the shared capture file interleave.
    os.write(1, f"rank {rank} of {world_size} to stdout\n".encode())
    os.write(2, f"rank {rank} of {world_size} to stderr\n".encode())
    return {"mark": os.environ.get(MARK), "cwd": os.getcwd(), "pid": os.getpid()}


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def test_ranks_see_the_callers_environment_directory_and_streams(tmp_path, monkeypatch, capfd):
    with capfd.disabled():  # a fork server started here holds other stdout/stderr than capfd's
        run_distributed(_pid, 2)
    for call in range(2):
        monkeypatch.setenv(MARK, f"call {call}")
        directory = tmp_path / str(call)
        directory.mkdir()
        monkeypatch.chdir(directory)
        seen = run_distributed(_what_the_rank_sees, 2)
        assert [rank["mark"] for rank in seen] == [f"call {call}"] * 2
        assert [rank["cwd"] for rank in seen] == [str(directory)] * 2
        assert len({rank["pid"] for rank in seen} | {os.getpid()}) == 3
        out, err = capfd.readouterr()
        for stream, text in (("stdout", out), ("stderr", err)):
            lines = sorted(line for line in text.splitlines() if line.startswith("rank "))
            assert lines == [f"rank {r} of 2 to {stream}" for r in range(2)]
