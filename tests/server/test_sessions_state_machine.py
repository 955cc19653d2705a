"""Hypothesis drives several clients of one server through lookup / retrieve / store /
end / abandoned store / disconnect in any order. After every step: the server's open
requests are exactly those the model says are open, its reference audit is clean, and every
retrieve returned the bytes stored for those tokens. At the end everything is released.

The server runs in this process (its real sockets, threads and shared memory, without the
seconds of a process start per example); the process tests cover the rest.
"""

from __future__ import annotations

import threading

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.server.client import ServerClient
from kvtier.server.daemon import KVTierServer
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, small_config
from tests.server.server_helpers import open_client, remove_tempdir, short_tempdir, wait_until

BASE = list(range(1000, 1000 + 2 * SMALL_CHUNK))
PROMPTS = [
    BASE + list(range(i * 100, i * 100 + n)) for i, n in ((1, 16), (2, 40), (3, 5), (4, 64))
] + [list(range(5000, 5000 + 3 * SMALL_CHUNK))]


def kv_for(tokens: list[int]) -> torch.Tensor:
    """KV whose every token's slice says which token it is: a chunk's bytes follow from its
    tokens alone, so any hit can be checked against what must have been stored."""
    values = torch.tensor(tokens, dtype=SMALL_LAYOUT.dtype).view(1, 1, -1, 1)
    return values.expand(SMALL_LAYOUT.kv_shape(len(tokens))).contiguous()


class Clients(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = short_tempdir()
        # 10 pages: fewer than the prompts need, so eviction and dropped stores happen
        config = small_config(cpu_chunks=10, server_max_clients=8)
        self.server = KVTierServer(config, f"{self.directory}/k.sock").open()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"unix://{self.server.path}"
        self.watcher = open_client(self.url)
        self.clients: list[ServerClient] = []
        self.open: list[set[str]] = []  # per client: request ids holding a lease
        self.next_rid = 0

    @precondition(lambda self: len(self.clients) < 3)
    @rule()
    def connect(self) -> None:
        self.clients.append(open_client(self.url))
        self.open.append(set())

    def _pick(self, data: st.DataObject) -> int:
        live = [i for i, c in enumerate(self.clients) if c.connected]
        return int(data.draw(st.sampled_from(live)))

    def _has_live(self) -> bool:
        return any(c.connected for c in self.clients)

    @precondition(_has_live)
    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS))
    def store(self, data: st.DataObject, prompt: list[int]) -> None:
        self.clients[self._pick(data)].store(prompt, kv_for(prompt))

    @precondition(_has_live)
    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS), fetch=st.booleans())
    def lookup_retrieve(self, data: st.DataObject, prompt: list[int], fetch: bool) -> None:
        i = self._pick(data)
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        hit = self.clients[i].lookup(prompt, rid).tokens
        if hit:  # a miss pinned nothing: the server ends it at once, keeping nothing
            self.open[i].add(rid)
        assert hit % SMALL_CHUNK == 0 and hit <= len(prompt)
        if fetch:
            kv = self.clients[i].retrieve(prompt, rid)
            assert kv.shape[2] <= hit  # a chunk may vanish from a lower tier; never grow
            assert torch.equal(kv, kv_for(prompt)[:, :, : kv.shape[2]])

    @precondition(lambda self: any(self.open[i] for i, c in enumerate(self.clients)))
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        i = int(data.draw(st.sampled_from([i for i, rids in enumerate(self.open) if rids])))
        rid = data.draw(st.sampled_from(sorted(self.open[i])))
        assert self.clients[i].end_request(rid)
        assert not self.clients[i].end_request(rid)  # a second end is a no-op
        self.open[i].discard(rid)

    @precondition(_has_live)
    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS))
    def abandoned_store(self, data: st.DataObject, prompt: list[int]) -> None:
        """The copy into the reserved pages fails: they go back unstored, nothing leaks."""
        client = self.clients[self._pick(data)]

        def fail(slots: object, kv: torch.Tensor, base: int) -> None:
            raise RuntimeError("device copy failed")

        client._pages.copy_in = fail  # type: ignore[method-assign]
        try:
            client.store(prompt + [7777], kv_for(prompt + [7777]))
        except RuntimeError:
            pass
        finally:
            del client._pages.copy_in

    @precondition(_has_live)
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        """The process goes away (close, crash: the server sees the same EOF) and a new
        one takes its place."""
        i = self._pick(data)
        self.clients[i].close()
        self.clients[i] = open_client(self.url)
        self.open[i] = set()

    @invariant()
    def server_holds_what_the_clients_hold(self) -> None:
        expected = sum(len(rids) for rids in self.open)
        wait_until(
            lambda: self.watcher.stats()["open_requests"] == expected,
            what=f"{expected} open requests on the server",
        )
        assert self.watcher.check_invariants() == []

    def teardown(self) -> None:
        try:
            for client in self.clients:
                client.close()
            wait_until(lambda: self.watcher.stats()["open_requests"] == 0, what="all released")
            stats = self.watcher.stats()
            assert stats["pinned_pages"] == 0
            assert stats["allocator"]["pages_used"] == stats["tiers"]["cpu"]["entries"]
            self.watcher.close()
        finally:
            self.server.stop()
            self.server.close()
            self.thread.join(5)
            remove_tempdir(self.directory)


Clients.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestClients = Clients.TestCase
