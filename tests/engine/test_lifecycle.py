"""Property-based lifecycle test: any interleaving of requests leaves nothing pinned.

The state machine drives many requests against a buffer of only a few chunks: lookups,
retrieves, stores, normal ends, repeated ends and aborts (a request that ends without ever
retrieving). After every step no refcount is negative and no page is freed while a cache
entry or a lease still owns it; at the end, with every request ended, each page is free or
owned by exactly one cache entry.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, small_config

# A small vocabulary of prompts that share prefixes, so hits, partial hits and duplicates
# all happen often.
BASES = [[(b * 7 + i) % 50 for i in range(SMALL_CHUNK * 4)] for b in range(3)]


def prompt(base: int, chunks: int, tail: int) -> list[int]:
    return BASES[base][: chunks * SMALL_CHUNK] + [1000 + tail] * (tail % 5)


prompts = st.builds(prompt, st.integers(0, 2), st.integers(1, 4), st.integers(0, 9))


class EngineLifecycle(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(
            small_config(cpu_chunks=4, save_unfull_chunk=True), SMALL_LAYOUT, model_name="m"
        ).open()
        self.counter = 0
        self.live: dict[str, list[int]] = {}
        self.stored: dict[tuple[int, ...], torch.Tensor] = {}

    def kv_for(self, tokens: list[int]) -> torch.Tensor:
        # KV is a pure function of the token prefix, so any served chunk can be checked.
        kv = make_kv(len(tokens), seed=0)
        for i, t in enumerate(tokens):
            kv[:, :, i, :] = float(t) + torch.arange(kv.shape[-1]) / 100
        return kv

    @rule(target=requests, tokens=prompts)
    def lookup(self, tokens: list[int]) -> str:
        self.counter += 1
        rid = f"r{self.counter}"
        hit = self.engine.lookup(tokens, rid).tokens
        assert 0 <= hit <= len(tokens)
        self.live[rid] = tokens
        return rid

    @rule(rid=requests)
    def retrieve(self, rid: str) -> None:
        tokens = self.live.get(rid)
        if tokens is None:
            return  # already ended: the engine would open a fresh lease; covered elsewhere
        kv = self.engine.retrieve(tokens, rid)
        assert torch.equal(kv, self.kv_for(tokens)[:, :, : kv.shape[2]])

    @rule(tokens=prompts)
    def store(self, tokens: list[int]) -> None:
        self.engine.store(tokens, self.kv_for(tokens))

    @rule(rid=requests)
    def end(self, rid: str) -> None:
        self.engine.end_request(rid)
        self.live.pop(rid, None)

    @rule(rid=requests)
    def end_twice(self, rid: str) -> None:
        self.engine.end_request(rid)
        assert self.engine.end_request(rid) is False
        self.live.pop(rid, None)

    @rule(tokens=prompts)
    def abort_after_lookup(self, tokens: list[int]) -> None:
        self.counter += 1
        rid = f"a{self.counter}"
        self.engine.lookup(tokens, rid)
        self.engine.end_request(rid)

    @invariant()
    def refcounts_are_consistent(self) -> None:
        assert self.engine.check_invariants() == []
        pinned = sum(i.pinned_pages for i in self.engine.leaks())
        assert pinned == self.engine.stats()["pinned_pages"]

    def teardown(self) -> None:
        for rid in list(self.live):
            self.engine.end_request(rid)
        assert self.engine.leaks() == []
        assert self.engine.check_invariants() == []
        stats = self.engine.stats()
        assert stats["pinned_pages"] == 0
        alloc = stats["allocator"]
        assert alloc["pages_used"] == stats["tiers"]["cpu"]["entries"]
        assert alloc["pages_free"] + alloc["pages_used"] == alloc["pages_total"]
        self.engine.close()


EngineLifecycle.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineLifecycle = EngineLifecycle.TestCase
