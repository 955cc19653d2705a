"""What one connection may hold, on every path: whole-frame deadlines (a Hello or a request
trickled a byte at a time does not keep a slot), bounded open requests and tokens (a miss
keeps nothing), and the pin share on lookup, retrieve and reserve alike (one large request
is cut to the share, never given every page).

The servers run in this process (``make_server``): real sockets and threads, seconds saved.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.server import handler
from kvtier.server import protocol as wire
from kvtier.server.client import ServerClient
from tests.conftest import SMALL_CHUNK, make_kv, make_tokens
from tests.server.server_helpers import (
    InProcess,
    open_client,
    remove_tempdir,
    short_tempdir,
    wait_until,
)

PAGES = 16  # make_server's default CPU tier
SHARE = PAGES // 2  # server_client_pin_share 0.5


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server closed its end (EOF or a reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def trickle() -> Iterator[object]:
    """``trickle(sock, data)``: send ``data`` one byte every 0.2 s on a thread, until all is
    sent or the server hangs up."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def send_slowly(sock: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if stop.wait(0.2):
                return
            try:
                sock.send(data[i : i + 1])
            except OSError:
                return

    def start(sock: socket.socket, data: bytes) -> None:
        thread = threading.Thread(target=send_slowly, args=(sock, data), daemon=True)
        thread.start()
        threads.append(thread)

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)


# -- 5: deadlines for whole frames, not per recv ---------------------------------------------
def test_a_hello_trickled_a_byte_at_a_time_loses_its_slot_at_the_hello_deadline(
    make_server: object, trickle: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients that each send a byte of their Hello every 0.2 s (each recv gets a byte
    well within any per-recv timeout) must not lock everyone out of a 2-client server."""
    monkeypatch.setattr(handler, "HELLO_TIMEOUT_S", 1.0)
    proc = make_server(server_max_clients=2)  # type: ignore[operator]
    with open_client(proc.url) as probe:
        hello = wire.encode(probe._link.hello)
    wait_until(lambda: len(proc.server.sessions) == 0, what="the probe's slot given back")
    slow = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(proc.path)
        trickle(sock, hello)  # type: ignore[operator]
        slow.append(sock)
    wait_until(lambda: len(proc.server.sessions) == 2, what="the slow clients admitted")
    started = time.monotonic()
    assert all(closed_within(sock, 5.0) for sock in slow)
    assert time.monotonic() - started < 4.0
    wait_until(lambda: len(proc.server.sessions) == 0, what="their slots given back")
    with open_client(proc.url) as client:
        assert client.connected
    for sock in slow:
        sock.close()


def test_a_request_trickled_after_the_hello_is_closed_at_the_frame_deadline(
    make_server: object, trickle: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "STALL_TIMEOUT_S", 1.0)
    proc = make_server()  # type: ignore[operator]
    client = open_client(proc.url)
    tokens = make_tokens(64, 3)
    client.store(tokens, make_kv(64, 3))
    assert client.lookup(tokens, "held").tokens == 64  # something its connection must give back
    sock = client._link.sock
    assert sock is not None
    trickle(sock, wire.encode(wire.Lookup("slow", packed(tokens))))  # type: ignore[operator]
    started = time.monotonic()
    assert closed_within(sock, 5.0)
    assert time.monotonic() - started < 4.0
    client.close()
    with open_client(proc.url) as other:
        wait_until(lambda: other.stats()["open_requests"] == 0, what="its request released")
        assert other.check_invariants() == []


# -- 6: open requests and the tokens they keep are bounded; a miss keeps nothing ----------------
def test_missed_lookups_keep_no_lease_and_no_keys(make_server: object) -> None:
    proc = make_server()  # type: ignore[operator]
    with open_client(proc.url) as client:
        for i in range(50):  # never ended, as a client that forgets its misses
            assert client.lookup(make_tokens(16 * 1024, 1000 + i), f"miss-{i}").tokens == 0
        assert client.stats()["open_requests"] == 0
        (session,) = proc.server.sessions.all()
        assert session.open_requests == 0 and session.open_tokens == 0
        tokens = make_tokens(64, 9)
        client.store(tokens, make_kv(64, 9))
        assert client.lookup(tokens, "hit").tokens == 64  # a hit stays open until it is ended
        assert client.stats()["open_requests"] == 1
        assert client.end_request("hit")


def test_open_requests_past_the_bound_are_refused_naming_the_key(make_server: object) -> None:
    proc = make_server(server_client_max_requests=3)  # type: ignore[operator]
    tokens = make_tokens(32, 4)
    with open_client(proc.url) as client:
        client.store(tokens, make_kv(32, 4))
        assert [client.lookup(tokens, f"r{i}").tokens for i in range(3)] == [32, 32, 32]
        reply = client._link.call(wire.Lookup("r3", packed(tokens)))
        assert isinstance(reply, wire.Failed) and reply.kind == "capacity"
        assert "3 requests open" in reply.message
        assert "server_client_max_requests" in reply.message
        assert client.lookup(tokens, "r4").tokens == 0  # the client sees a miss, not an error
        assert client.lookup(tokens, "r0").tokens == 32  # an open request may look up again
        assert client.end_request("r0")
        assert client.lookup(tokens, "r5").tokens == 32  # room again once one ended
        assert client.stats()["open_requests"] == 3


def test_tokens_kept_past_the_bound_are_refused_naming_the_key(make_server: object) -> None:
    proc = make_server(server_client_max_tokens=100)  # type: ignore[operator]
    tokens = make_tokens(64, 5)
    with open_client(proc.url) as client:
        client.store(tokens, make_kv(64, 5))
        assert client.lookup(tokens, "a").tokens == 64
        reply = client._link.call(wire.Lookup("b", packed(tokens)))
        assert isinstance(reply, wire.Failed) and reply.kind == "capacity"
        assert "128 tokens" in reply.message and "server_client_max_tokens" in reply.message
        reply = client._link.call(wire.Lookup("big", packed(make_tokens(4096, 6))))
        assert isinstance(reply, wire.Failed)  # refused even though it would miss
        assert client.end_request("a")
        assert client.lookup(tokens, "b").tokens == 64
        assert client.stats()["open_requests"] == 1


@pytest.mark.parametrize(("key", "value"), [("server_client_max_requests", 0),
                                            ("server_client_max_tokens", -1)])  # fmt: skip
def test_the_bounds_are_validated(key: str, value: int) -> None:
    from kvtier.config import Config
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        Config.load(overrides={key: value}, env={})


# -- 4: the pin share on every path that pins -------------------------------------------------
def pinned(proc: InProcess) -> list[int]:
    """Pages each connection holds pinned now."""
    engine = proc.server.models.slots()[0].engine
    return [s.pinned_pages(engine) for s in proc.server.sessions.all()]


def store_in_shares(client: ServerClient, tokens: list[int], seed: int) -> int:
    """Store ``tokens`` a share at a time (one store gets pages for at most a share)."""
    kv = make_kv(len(tokens), seed)
    step = SHARE * SMALL_CHUNK
    return sum(client.store(tokens, kv, skip_leading_tokens=s) for s in range(0, len(tokens), step))


def test_one_lookup_gets_a_hit_cut_to_the_share(make_server: object) -> None:
    proc = make_server()  # type: ignore[operator]
    tokens = make_tokens(12 * SMALL_CHUNK, 10)  # 12 chunks cached, share of 8
    with open_client(proc.url) as client:
        assert store_in_shares(client, tokens, 10) == 12
        assert client.lookup(tokens, "all").tokens == SHARE * SMALL_CHUNK
        assert client.stats()["pinned_pages"] == SHARE
        assert client.lookup(tokens, "more").tokens == 0  # at the share: nothing more, kept nothing
        assert client.stats()["open_requests"] == 1


def test_retrieve_without_a_lookup_is_within_the_share(make_server: object) -> None:
    proc = make_server()  # type: ignore[operator]
    tokens = make_tokens(12 * SMALL_CHUNK, 11)
    with open_client(proc.url) as client, open_client(proc.url) as other:
        assert store_in_shares(client, tokens, 11) == 12
        ends = []
        for i in range(4):  # no Lookup first: the engine would look them up itself
            reply = client._link.call(wire.Retrieve(f"r{i}", packed(tokens)))
            assert isinstance(reply, wire.Pages)
            ends.append(reply.end)
            assert sum(pinned(proc)) <= SHARE
        assert ends == [SHARE * SMALL_CHUNK, 0, 0, 0]
        kv = client.retrieve(tokens, "r0")  # looked up by its first Retrieve: same pins
        assert kv.shape[2] == SHARE * SMALL_CHUNK
        assert torch_equal(kv, make_kv(len(tokens), 11)[:, :, : SHARE * SMALL_CHUNK])
        fresh = make_tokens(4 * SMALL_CHUNK, 12)
        assert other.store(fresh, make_kv(len(fresh), 12)) == 4


def test_a_reserve_past_the_share_is_shortened(make_server: object) -> None:
    proc = make_server()  # type: ignore[operator]
    tokens = make_tokens(12 * SMALL_CHUNK, 13)
    with open_client(proc.url) as client:
        reply = client._link.call(wire.Reserve(1, packed(tokens)))
        assert isinstance(reply, wire.Pages) and len(reply.pages) == SHARE
        assert reply.starts == [i * SMALL_CHUNK for i in range(SHARE)]
        assert sum(pinned(proc)) == SHARE
        assert client._link.call(wire.Commit(1)) == wire.Stored(SHARE)
        assert client.store(tokens, make_kv(len(tokens), 13), skip_leading_tokens=128) == 4
        assert client.lookup(tokens, "x").tokens == SHARE * SMALL_CHUNK  # cut to the share as well
        assert client.check_invariants() == []


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return torch.equal(a, b)


PROMPTS = [make_tokens(n * SMALL_CHUNK, 500 + n) for n in (3, 6, 12)]


class PinShare(RuleBasedStateMachine):
    """A hog that never ends what it looks up, retrieves without lookups, and stores; a
    neighbour that only stores fresh prompts. Whatever the hog does, it holds at most its
    share pinned and the neighbour's stores go in whole."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = short_tempdir()
        self.proc = InProcess(self.directory)
        self.hog = open_client(self.proc.url)
        self.neighbour = open_client(self.proc.url)
        self.rids = 0
        self.open: set[str] = set()
        self.fresh = 0

    def _rid(self) -> str:
        self.rids += 1
        return f"h{self.rids}"

    @rule(prompt=st.sampled_from(PROMPTS))
    def hog_stores(self, prompt: list[int]) -> None:
        store_in_shares(self.hog, prompt, 500 + len(prompt) // SMALL_CHUNK)

    @rule(prompt=st.sampled_from(PROMPTS), skip=st.sampled_from([0, SMALL_CHUNK]))
    def hog_looks_up(self, prompt: list[int], skip: int) -> None:
        rid = self._rid()
        hit = self.hog.lookup(prompt, rid, skip_leading_tokens=skip).tokens
        assert hit <= len(prompt)
        if hit > skip // SMALL_CHUNK * SMALL_CHUNK:
            self.open.add(rid)

    @rule(prompt=st.sampled_from(PROMPTS), after_lookup=st.booleans())
    def hog_retrieves(self, prompt: list[int], after_lookup: bool) -> None:
        rid = self._rid()
        if after_lookup and self.hog.lookup(prompt, rid).tokens:
            self.open.add(rid)
        reply = self.hog._link.call(wire.Retrieve(rid, packed(prompt)))
        assert isinstance(reply, wire.Pages)
        if reply.end:
            self.open.add(rid)

    @rule(prompt=st.sampled_from(PROMPTS))
    def hog_reserves_and_abandons(self, prompt: list[int]) -> None:
        self.rids += 1
        reply = self.hog._link.call(wire.Reserve(self.rids, packed(prompt)))
        assert isinstance(reply, wire.Pages)
        assert self.hog.stats()["pinned_pages"] <= SHARE  # the reserved pages included
        assert self.hog._link.call(wire.Commit(self.rids, ok=False)) == wire.Stored(0)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def hog_ends_one(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.open)))
        self.open.discard(rid)
        assert self.hog.end_request(rid)

    @rule()
    def neighbour_stores(self) -> None:
        self.fresh += 1
        tokens = make_tokens(4 * SMALL_CHUNK, 9000 + self.fresh)
        assert self.neighbour.store(tokens, make_kv(len(tokens), 9000 + self.fresh)) == 4

    @invariant()
    def assert_within_share(self) -> None:
        hog = self.hog.stats()
        assert hog["pinned_pages"] <= SHARE  # only the hog pins
        assert hog["open_requests"] == len(self.open)
        assert self.hog.check_invariants() == []

    def teardown(self) -> None:
        try:
            self.hog.close()
            self.neighbour.close()
        finally:
            self.proc.close()
            remove_tempdir(self.directory)


PinShare.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
TestPinShare = PinShare.TestCase


def test_client_reads_a_refusal_as_a_miss(make_server: object) -> None:
    """The client library turns ``Failed("capacity")`` into a miss and stays connected."""
    proc = make_server(server_client_max_requests=1)  # type: ignore[operator]
    tokens = make_tokens(32, 14)
    client: ServerClient
    with open_client(proc.url) as client:
        client.store(tokens, make_kv(32, 14))
        assert client.lookup(tokens, "a").tokens == 32
        assert client.lookup(tokens, "b").tokens == 0
        assert client.stats()["connects"] == 1 and client.unserved == 1
