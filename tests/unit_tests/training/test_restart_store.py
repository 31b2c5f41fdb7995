"""A restarted worker group agrees on a store namespace of its own inside torchrun's shared store
(initialize._attempt_store), whatever a killed group left there. End to end under torchrun:
tests/functional_tests/test_chaos_restart.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from megatron.training import initialize
from tests.launch import free_port

WORLD_SIZE = 3


def _group(port: int, monkeypatch) -> list[dist.Store]:
    """Run _attempt_store for ranks 0..2 in threads (rank 0 last, as a slow rank 0 would)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores: dict[int, dist.Store] = {}

    def run(rank: int) -> None:
        stores[rank] = initialize._attempt_store(rank, WORLD_SIZE)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (1, 2, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(stores) == [0, 1, 2]
    return [stores[rank] for rank in range(WORLD_SIZE)]


def test_each_group_gets_a_fresh_namespace_despite_a_killed_groups_keys(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    first = _group(port, monkeypatch)
    first[0].set("rank_0_address", "dead")  # what gloo keeps there, for one
    # A killed rank of that group had queued itself but died before writing its token.
    handshake = dist.PrefixStore("megatron-fp8/handshake", server)
    handshake.add("queue", 1)

    second = _group(port, monkeypatch)
    for rank in range(WORLD_SIZE):  # every rank of a group shares one namespace
        second[rank].set(f"seen_by_{rank}", str(rank))
    for rank in range(WORLD_SIZE):
        assert [second[rank].get(f"seen_by_{other}") for other in range(WORLD_SIZE)] == [
            b"0",
            b"1",
            b"2",
        ]
    # and none of the killed group's keys is visible in it
    assert not second[1].check(["rank_0_address"])
    assert first[1].get("rank_0_address") == b"dead"
    assert int(handshake.add("queue", 0)) == 2 * (WORLD_SIZE - 1) + 1


def test_without_torchrun_shared_store_init_process_group_builds_its_own(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert initialize._attempt_store(0, 2) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # torchrun, sharing disabled
    assert initialize._attempt_store(0, 2) is None
