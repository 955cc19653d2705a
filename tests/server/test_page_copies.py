"""A server client's copies between device memory and the server's shared pages
(kvtier.server.page_copies), and what the client does while they land.

No GPU here: the client's copies into or out of "device" memory land only when code waits on
their fence, or when the test releases them (tests/memory/late_copies.py).

Loads: the server's pages are not given back while a copy out of them still runs
(``end_request`` and a lost connection wait for the loads in flight). Each scenario loads A
into device memory, gives A's pages back (its request ends, or its connection is lost), then
stores B into every page A had; the device must still get A. With a fence that lies
("landed" at once, no wait) it must get B's bytes, so the scenario can fail.

Stores: the client's lock is not held while a store's copies land (another thread's lookup
goes on meanwhile), and what it kept in order still holds: a connection lost meanwhile is
dropped only once the copies landed, and one store at a time goes on the connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier.errors import TransferError
from kvtier.server.client import ServerClient
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens
from tests.memory.late_copies import LateCopies
from tests.server.server_helpers import (
    CHUNK_BYTES,
    InProcess,
    client_config,
    remove_tempdir,
    short_tempdir,
    wait_until,
)

CHUNKS = 4
TOKENS = CHUNKS * SMALL_CHUNK


@pytest.fixture
def server() -> Iterator[InProcess]:
    """A server whose CPU tier holds exactly one prompt's chunks: the next prompt stored
    takes every page of the last."""
    directory = short_tempdir()
    served = InProcess(
        directory,
        chunk_size=SMALL_CHUNK,
        max_local_cpu_size=f"{CHUNKS * CHUNK_BYTES}B",
        server_client_pin_share=1.0,  # one connection may reserve (or pin) every page
    )
    try:
        yield served
    finally:
        served.close()
        remove_tempdir(directory)


def client(server: InProcess, copies: LateCopies | None = None) -> ServerClient:
    return ServerClient(
        server.url, SMALL_LAYOUT, model_name="fence", config=client_config(), copies=copies
    ).open()


def store_all(writer: ServerClient, tokens: list[int], kv: torch.Tensor) -> None:
    """Store every chunk (a page still held by a lease the server has not released yet
    drops a chunk: store again until all are in)."""
    stored = [0]

    def done() -> bool:
        stored[0] += writer.store(tokens, kv)
        return stored[0] == CHUNKS

    wait_until(done, what="B's store to get every page")


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_end_request_waits_for_a_load_still_landing(server: InProcess, lying: bool) -> None:
    copies = LateCopies(lying=lying)
    a_tokens, a_kv = make_tokens(TOKENS, 46001), make_kv(TOKENS, 46001)
    b_tokens, b_kv = make_tokens(TOKENS, 46002), make_kv(TOKENS, 46002)
    out = copies.mark(torch.zeros_like(a_kv))
    with client(server, copies) as reader:
        assert reader.store(a_tokens, a_kv) == CHUNKS  # host KV: copied at once
        assert reader.lookup(a_tokens + [1], "a").tokens == TOKENS
        assert reader.retrieve_into(a_tokens + [1], "a", out) == TOKENS
        assert copies.pending() == 1  # the load is in flight
        reader.end_request("a")  # the server's lease of A's pages ends here
        store_all(reader, b_tokens, b_kv)  # every page of A, written again
        copies.drain()
        assert reader.check_invariants() == []
    assert torch.equal(out, a_kv) is not lying


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_loads_in_flight_land_before_a_lost_connection_gives_their_pages_back(
    server: InProcess, lying: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client finds its connection broken (a reply it cannot read) while a load into
    device memory is in flight: it drops the socket, and the server releases everything
    the connection held at once. The copies must have landed first."""
    copies = LateCopies(lying=lying)
    a_tokens, a_kv = make_tokens(TOKENS, 46003), make_kv(TOKENS, 46003)
    b_tokens, b_kv = make_tokens(TOKENS, 46004), make_kv(TOKENS, 46004)
    out = copies.mark(torch.zeros_like(a_kv))
    with client(server) as writer, client(server, copies) as reader:
        assert writer.store(a_tokens, a_kv) == CHUNKS
        assert reader.lookup(a_tokens + [1], "a").tokens == TOKENS
        assert reader.retrieve_into(a_tokens + [1], "a", out) == TOKENS

        def broken(request: object) -> object:
            raise TransferError("a reply this client cannot read")

        with monkeypatch.context() as patch:
            patch.setattr(reader._link, "call", broken)
            reader.stats()  # the next call meets the broken connection: lost
        assert not reader.connected
        store_all(writer, b_tokens, b_kv)  # the server released A's pages: B takes them
        copies.drain()
        assert writer.check_invariants() == []
    assert torch.equal(out, a_kv) is not lying


def test_a_lookup_goes_on_while_a_stores_copies_land(server: InProcess) -> None:
    """A store's copies from device memory are held (a slow device); meanwhile another
    thread's lookup on the same client is answered, not queued behind the copies."""
    copies = LateCopies(waits_land=False)  # they land at release(), whoever waits
    tokens, kv = make_tokens(TOKENS, 46005), copies.mark(make_kv(TOKENS, 46005))
    other = make_tokens(TOKENS, 46006)
    with client(server, copies) as shared:
        stored: list[int] = []
        store = threading.Thread(target=lambda: stored.append(shared.store(tokens, kv)))
        store.start()
        try:
            wait_until(lambda: copies.pending() == 1, what="the store's copies to be queued")
            looked: list[int] = []
            lookup = threading.Thread(
                target=lambda: looked.append(shared.lookup(other, "other").tokens), daemon=True
            )
            lookup.start()
            lookup.join(10)
            assert looked == [0], "a lookup waited for another thread's store to land"
            assert copies.pending() == 1 and store.is_alive()  # the store still waits
        finally:
            copies.release()
            store.join(30)
        assert stored == [CHUNKS]
        assert shared.lookup(tokens + [1], "a").tokens == TOKENS
        shared.end_request("a")
        shared.end_request("other")
        assert shared.check_invariants() == []


def test_a_connection_lost_while_a_stores_copies_land_is_dropped_after_them(
    server: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread finds the connection broken while a store's copies are still on their
    way into the reserved pages. The server releases the reservation the moment the socket
    closes, so the drop waits for the copies; the store is then dropped (its reservation
    went with the connection), never committed on the next one."""
    copies = LateCopies(waits_land=False)
    tokens, kv = make_tokens(TOKENS, 46007), copies.mark(make_kv(TOKENS, 46007))
    with client(server, copies) as shared:
        stored: list[int] = []
        store = threading.Thread(target=lambda: stored.append(shared.store(tokens, kv)))
        store.start()
        wait_until(lambda: copies.pending() == 1, what="the store's copies to be queued")

        def broken(request: object) -> object:
            raise TransferError("a reply this client cannot read")

        with monkeypatch.context() as patch:
            patch.setattr(shared._link, "call", broken)
            lost = threading.Thread(target=shared.stats)
            lost.start()
            lost.join(0.5)
            assert lost.is_alive() and shared.connected  # the drop waits for the copies
            copies.release()
            lost.join(30)
            store.join(30)
            assert not shared.connected
        assert stored == [0]  # dropped: the reservation went with the connection
        assert shared.lookup(tokens + [1], "a").tokens == 0  # reconnected: nothing stored
        shared.end_request("a")
        assert shared.check_invariants() == []


def test_stores_from_two_threads_take_turns_on_the_connection(server: InProcess) -> None:
    """The server takes no Reserve before the last store's Commit: while one thread's store
    copies (outside the client's lock), another thread's store waits for it to commit."""
    copies = LateCopies(waits_land=False)
    half = TOKENS // 2
    prompts = [(make_tokens(half, seed), copies.mark(make_kv(half, seed))) for seed in (8, 9)]
    with client(server, copies) as shared:
        stored: dict[int, int] = {}

        def store(i: int) -> None:
            stored[i] = shared.store(*prompts[i])

        first = threading.Thread(target=store, args=(0,))
        first.start()
        wait_until(lambda: copies.pending() == 1, what="the first store's copies")
        second = threading.Thread(target=store, args=(1,))
        second.start()
        second.join(0.5)
        assert copies.pending() == 1  # the second has not reserved: the first is not in

        def both_done() -> bool:
            copies.release()
            return not first.is_alive() and not second.is_alive()

        wait_until(both_done, what="both stores")
        assert stored == {0: CHUNKS // 2, 1: CHUNKS // 2}
        assert shared.connected and shared.check_invariants() == []
