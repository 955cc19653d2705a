"""What one model or one client may hold in a server: a total memory budget with idle models
released (their disk tier kept), a Hello deadline, a per-connection pin budget, and requests
with impossible arguments refused."""

from __future__ import annotations

import math
import os
import socket

import pytest

from kvtier.server import handler
from kvtier.server import protocol as wire
from tests.conftest import make_kv, make_tokens
from tests.server.server_helpers import CHUNK_BYTES, open_client, wait_until


def test_idle_models_are_released_and_their_disk_tier_kept(
    make_server: object, tempdir: str
) -> None:
    disk = os.path.join(tempdir, "disk")
    proc = make_server(  # type: ignore[operator]
        server_model_idle_secs=0.5, local_disk=f"file://{disk}", max_local_disk_size="1MiB"
    )
    tokens = make_tokens(64, 71)
    with open_client(proc.url) as client:
        assert client.store(tokens, make_kv(64, 71)) == 4
        assert client.flush(30.0)
    wait_until(lambda: proc.server.models.slots() == [], what="the idle model released")
    assert proc.server.models.released == 1
    with open_client(proc.url) as client:
        assert client.lookup(tokens, "again").tokens == 64  # from the disk tier it kept
        client.end_request("again")


def test_a_model_that_does_not_fit_is_refused_until_another_goes_idle(
    make_server: object,
) -> None:
    proc = make_server(  # type: ignore[operator]
        server_max_memory=f"{24 * CHUNK_BYTES}B", server_model_idle_secs=3600
    )
    first = open_client(proc.url, model_name="first")
    assert first.connected
    second = open_client(proc.url, model_name="second")
    assert not second.connected
    assert "server_max_memory" in second._link.last_error
    assert second.lookup(make_tokens(32, 1), "r").tokens == 0  # a miss, not an error
    first.close()  # idle now (a long grace): released when the room is needed
    wait_until(lambda: proc.server.models.slots()[0].clients == 0, what="first idle")
    wait_until(lambda: second._link.ensure(), what="second served")
    assert [s.fingerprint for s in proc.server.models.slots()] == [second.fingerprint.hex()]
    second.close()


def test_a_silent_connection_loses_its_slot_at_the_hello_deadline(
    make_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handler, "HELLO_TIMEOUT_S", 0.5)
    proc = make_server(server_max_clients=2)  # type: ignore[operator]
    silent = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(proc.path)
        silent.append(sock)
    wait_until(lambda: len(proc.server.sessions) == 2, what="silent connections admitted")
    wait_until(lambda: len(proc.server.sessions) == 0, what="silent connections closed")
    with open_client(proc.url) as client:
        assert client.connected
    for sock in silent:
        sock.close()


def test_one_client_cannot_pin_every_page(make_server: object) -> None:
    """A client that never ends its requests holds at most half the pages pinned; another
    client's store still finds room."""
    proc = make_server()  # type: ignore[operator]  # 16 pages
    with open_client(proc.url) as hog, open_client(proc.url) as other:
        for seed in range(4):  # 4 prompts of 4 chunks fill the 16 pages
            hog.store(make_tokens(64, 100 + seed), make_kv(64, 100 + seed))
        hits = [hog.lookup(make_tokens(64, 100 + seed), f"hog-{seed}").tokens for seed in range(4)]
        assert hits == [64, 64, 0, 0]  # cached, but the last two are past its budget
        assert hog.stats()["pinned_pages"] == 8
        assert other.store(make_tokens(64, 200), make_kv(64, 200)) > 0


def test_impossible_requests_are_refused(make_server: object) -> None:
    proc = make_server()  # type: ignore[operator]
    with open_client(proc.url) as client:
        link = client._link
        for bad in (math.nan, -5.0, math.inf):
            reply = link.call(wire.Flush(bad))
            assert isinstance(reply, wire.Failed) and "Flush timeout" in reply.message
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(proc.path)
    hello = client._link.hello
    wire.send(
        sock,
        wire.Hello(**{**{f: getattr(hello, f) for f in hello.__struct_fields__}, "version": 99}),
    )
    reply = wire.reader(sock).read()
    assert isinstance(reply, wire.Refused) and "version 99" in reply.message
    sock.close()
