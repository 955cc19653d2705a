"""The server killed (SIGKILL) in the middle of busy clients: no call raises, every call
after is a miss, and hits come back by themselves once a server listens again."""

from __future__ import annotations

import threading

import torch

from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import (
    InProcess,
    ServerProcess,
    open_client,
    remove_tempdir,
    short_tempdir,
    wait_until,
)


def test_clients_survive_a_server_killed_mid_call() -> None:
    directory = short_tempdir()
    proc = ServerProcess(directory, max_local_cpu_size="4MiB").start()
    errors: list[BaseException] = []
    rounds = [0, 0]
    hits = [0, 0]
    stop = threading.Event()

    def busy(index: int) -> None:
        client = open_client(proc.url, max_backoff=0.1)
        tokens, kv = make_tokens(96, 7), make_kv(96, 7)
        out = torch.empty(SMALL_LAYOUT.kv_shape(96), dtype=SMALL_LAYOUT.dtype)
        try:
            while not stop.is_set():
                rid = f"busy-{index}-{rounds[index]}"
                client.store(tokens, kv)
                hit = client.lookup(tokens, rid).tokens
                end = client.retrieve_into(tokens, rid, out)
                client.end_request(rid)
                if end:
                    assert torch.equal(out[:, :, :end], kv[:, :, :end])
                hits[index] += hit > 0
                rounds[index] += 1
        except BaseException as exc:  # any exception is the failure under test
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: min(hits) > 20, what="hits before the kill")
        proc.kill()  # in the middle of whatever call each client is making
        at_kill = list(rounds)  # the calls in flight at the kill: each client finishes one
        wait_until(lambda: all(r > k for r, k in zip(rounds, at_kill, strict=True)),
                   what="each client's round in flight at the kill to end")  # fmt: skip
        before = list(rounds)
        wait_until(lambda: min(r - b for r, b in zip(rounds, before, strict=True)) > 50,
                   what="clients still serving with no server")  # fmt: skip
        hits_while_dead = list(hits)
        proc.start()
        wait_until(lambda: all(h > d for h, d in zip(hits, hits_while_dead, strict=True)),
                   what="hits again after the restart")  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        proc.stop()
        remove_tempdir(directory)
    assert errors == []


def test_a_request_whose_lookup_found_no_server_loads_nothing_once_one_listens() -> None:
    # A request loads what its lookup said. Asked of a server that came (or came back) after
    # the lookup, a retrieve would be a fresh lookup there, and could return more.
    directory = short_tempdir()
    url = f"unix://{directory}/kvtier.sock"
    tokens, kv = make_tokens(96, 7), make_kv(96, 7)
    client = open_client(url, max_backoff=0.05)
    server = None
    try:
        assert client.lookup(tokens, "early").tokens == 0  # no server: answered here
        server = InProcess(directory)
        writer = open_client(url)
        writer.store(tokens, kv)
        writer.close()
        wait_until(lambda: client.lookup(tokens, "probe").tokens == 96, what="the server's hit")
        client.end_request("probe")
        out = torch.empty(SMALL_LAYOUT.kv_shape(96), dtype=SMALL_LAYOUT.dtype)
        assert client.retrieve_into(tokens, "early", out) == 0
        assert client.retrieve(tokens, "early").shape[2] == 0
        client.end_request("early")
        with client.request("late"):  # a request looked up now hits, and loads it
            assert client.lookup(tokens, "late").tokens == 96
            assert torch.equal(client.retrieve(tokens, "late"), kv)
    finally:
        client.close()
        if server is not None:
            server.close()
        remove_tempdir(directory)
