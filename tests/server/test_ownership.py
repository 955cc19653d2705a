"""A client killed with SIGKILL, in the middle of a retrieve or a store, leaves nothing held:
the kernel closes its socket and the server ends every request of that connection."""

from __future__ import annotations

import os
import random
import signal
import time

from tests.conftest import make_kv, make_tokens
from tests.server.conftest import SPAWN
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    idle_server_state,
    open_client,
    remove_tempdir,
    short_tempdir,
    wait_until,
)
from tests.server.workers import churn, hold_retrieve, hold_store


def kill9(process: object) -> None:
    pid = process.pid  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)
    process.join(30)  # type: ignore[attr-defined]


def test_kill9_while_holding_a_retrieve_lease(server: ServerProcess) -> None:
    with open_client(server.url) as watcher:
        watcher.store(make_tokens(96, 51), make_kv(96, 51))
        before = watcher.stats()
        results = SPAWN.Queue()
        child = SPAWN.Process(target=hold_retrieve, args=(server.url, 96, 51, results))
        child.start()
        assert results.get(timeout=60) == 96
        held = watcher.stats()
        assert held["pinned_pages"] == before["pinned_pages"] + 6  # pinned by the child
        kill9(child)
        wait_until(lambda: watcher.stats()["pinned_pages"] == before["pinned_pages"])
        assert idle_server_state(watcher) == IDLE
        assert watcher.lookup(make_tokens(96, 51), "after").tokens == 96  # the chunks stay cached
        watcher.end_request("after")


def test_kill9_in_the_middle_of_a_store(server: ServerProcess) -> None:
    with open_client(server.url) as watcher:
        used = watcher.stats()["allocator"]["pages_used"]
        results = SPAWN.Queue()
        child = SPAWN.Process(target=hold_store, args=(server.url, 80, 52, results))
        child.start()
        assert results.get(timeout=60) == 5  # pages reserved, being filled
        assert watcher.stats()["allocator"]["pages_used"] == used + 5
        assert watcher.stats()["open_requests"] == 1  # the reservation's lease
        kill9(child)
        wait_until(lambda: watcher.stats()["allocator"]["pages_used"] == used)
        assert idle_server_state(watcher) == IDLE
        assert watcher.lookup(make_tokens(80, 52), "half-stored").tokens == 0  # never published
        watcher.end_request("half-stored")


def test_kill9_at_random_moments_of_busy_clients() -> None:
    """Three clients storing and retrieving as fast as they can, each killed at a random
    moment (three rounds): every time, nothing is left held and the audit is clean."""
    directory = short_tempdir()
    # a small buffer, so evictions, drops and reservations all happen under the kills
    proc = ServerProcess(directory, max_local_cpu_size=f"{24 * 4096}B").start()
    rng = random.Random(3)
    try:
        with open_client(proc.url) as watcher:
            for round_ in range(3):
                results = SPAWN.Queue()
                children = [
                    SPAWN.Process(target=churn, args=(proc.url, 10 * round_ + i, results))
                    for i in range(3)
                ]
                for child in children:
                    child.start()
                for _ in range(3):
                    results.get(timeout=60)  # each is running
                for child in children:
                    time.sleep(rng.uniform(0.0, 0.3))
                    kill9(child)
                wait_until(lambda: watcher.stats()["open_requests"] == 0, what="all released")
                # The server notices each dead peer when its socket read fails: a moment
                # after its leases may already be gone, under load.
                wait_until(
                    lambda: watcher.stats()["server"]["clients"] == 1, what="only the watcher"
                )
                assert idle_server_state(watcher) == IDLE
    finally:
        proc.stop()
        remove_tempdir(directory)
