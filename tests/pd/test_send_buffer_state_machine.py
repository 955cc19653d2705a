"""Hypothesis drives the prefiller's send buffer through hold / claim (right keys, wrong keys,
twice) / serve / fail mid-serve / TTL expiry / close in any order; after every step each page's
refcount equals the live transfers holding it and the free list matches; a transfer ends once
whichever of serving, failing and expiry comes first (a second end gives nothing back); a key
already held takes one reference for the new transfer and nothing more (LMCache #2847); at the
end everything is free."""

from __future__ import annotations

import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.memory.block_pool import pages_for_capacity
from kvtier.pd.send_buffer import ClaimRefused, SendBuffer, State, Transfer

KEYS = [os.urandom(16) for _ in range(7)]
PAGE_BYTES = 64
PAGES = pages_for_capacity("pd_buffer_size", 4 * PAGE_BYTES + 17, PAGE_BYTES)  # 4: a ceiling
TTL = 10.0


def fill(i: int, page: torch.Tensor) -> None:
    page.fill_(i)


class SendBufferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.buffer = SendBuffer(PAGES, PAGE_BYTES, ttl=TTL, clock=lambda: self.now).open()
        self.open: dict[str, list[bytes]] = {}  # transfer -> keys it holds (unclaimed)
        self.claimed: dict[str, Transfer] = {}
        self.ended: set[str] = set()
        self.next_id = 0

    @rule(prefix=st.integers(1, 4), data=st.data())
    def hold(self, prefix: int, data: st.DataObject) -> None:
        """A new transfer, or more chunks of an open one (a later prefill step)."""
        names = sorted(self.open)
        tid = data.draw(st.sampled_from([*names, "new"])) if names else "new"
        if tid == "new":
            tid = f"t{self.next_id}"
            self.next_id += 1
        start = len(self.open.get(tid, []))
        keys = KEYS[start : start + prefix]  # prompt order: every transfer is a prefix of KEYS
        used = self.buffer.pool.used_pages
        already = sum(1 for k in keys if k in self.buffer._index)
        added = self.buffer.hold(tid, keys, [16] * len(keys), fill)
        held = self.open.setdefault(tid, [])
        held.extend(keys[:added])
        # Shared keys cost no page; new ones one each, until the buffer is full.
        assert added < len(keys) or self.buffer.pool.used_pages - used == added - already

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), right=st.booleans())
    def claim(self, data: st.DataObject, right: bool) -> None:
        """The decoder's keys: this prompt's (right), or another prompt's / salt's."""
        tid = data.draw(st.sampled_from(sorted(self.open)))
        held = self.open[tid]
        keys = KEYS if right else KEYS[::-1]
        expected = right or not held  # a transfer that holds nothing matches any prompt
        try:
            transfer = self.buffer.claim(tid, keys)
        except ClaimRefused as exc:
            assert not expected and exc.kind == "mismatch"
            assert self.buffer.transfer(tid) is not None  # still there for the right decoder
            return
        assert expected and transfer.state is State.CLAIMED and transfer.keys == held
        self.claimed[tid] = transfer
        del self.open[tid]
        try:
            self.buffer.claim(tid, keys)
            raise AssertionError("a transfer was claimed twice")
        except ClaimRefused as exc:
            assert exc.kind == "claimed"

    @precondition(lambda self: bool(self.claimed))
    @rule(data=st.data(), served=st.booleans())
    def end_claimed(self, data: st.DataObject, served: bool) -> None:
        """Served to the end, or the pull failed mid-way: either ends it, once."""
        tid = data.draw(st.sampled_from(sorted(self.claimed)))
        transfer = self.claimed.pop(tid)
        if served:
            for i in range(len(transfer.keys)):
                assert self.buffer.chunk_view(transfer, i, PAGE_BYTES).numel() == PAGE_BYTES
        assert self.buffer.end(transfer)
        free = self.buffer.pool.free_pages
        assert not self.buffer.end(transfer)  # a second end is a no-op
        assert self.buffer.pool.free_pages == free
        self.ended.add(tid)

    @rule(seconds=st.sampled_from([1.0, TTL + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        expired = set(self.buffer.expire())
        late = {t for t in self.open if self.buffer.transfer(t) is None}
        assert expired == late  # only unclaimed transfers expire
        assert not expired & set(self.claimed)
        for tid in expired:
            del self.open[tid]
            self.ended.add(tid)

    @precondition(lambda self: bool(self.ended))
    @rule(data=st.data())
    def claim_an_ended_transfer(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.ended)))
        try:
            self.buffer.claim(tid, KEYS)
            raise AssertionError("an ended transfer was claimed")
        except ClaimRefused as exc:
            assert exc.kind == "unknown"

    @invariant()
    def every_page_is_free_or_owned(self) -> None:
        assert self.buffer.check_invariants() == []
        owned = {p for t in self.claimed.values() for p in t.pages}
        for tid in self.open:
            transfer = self.buffer.transfer(tid)
            assert transfer is not None
            owned |= set(transfer.pages)
        assert self.buffer.pool.used_pages == len(owned)

    def teardown(self) -> None:
        for transfer in self.claimed.values():
            self.buffer.end(transfer)
        self.now += TTL + 1
        self.buffer.expire()
        assert self.buffer.pool.free_pages == PAGES
        assert self.buffer._index == {} and self.buffer.check_invariants() == []
        self.buffer.close()


SendBufferMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None
)
TestSendBuffer = SendBufferMachine.TestCase


def test_the_buffer_is_a_ceiling_in_whole_chunks() -> None:
    assert PAGES == 4
