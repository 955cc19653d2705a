"""A server client's loads into device memory: the server's shared pages are not given back
while a copy out of them still runs (kvtier.server.client: ``end_request`` and a lost
connection wait for the loads in flight).

No GPU here: the client's copies into "device" memory land only when code waits on their
fence, or when the test drains them (tests/memory/late_copies.py). Each scenario loads A
into device memory, gives A's pages back (its request ends, or its connection is lost),
then stores B into every page A had; the device must still get A. With a fence that lies
("landed" at once, no wait) it must get B's bytes, so the scenario can fail."""

from __future__ import annotations

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
