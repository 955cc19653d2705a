"""Hypothesis drives the receive buffer through reserve / receive / lookup pin / end /
abort / sender death / expiry of unclaimed requests in any order; after every step each
page's refcount equals its owners (live reservations + key pins) and the free list matches;
whichever of expiry, abort and the request's own end comes first releases a reservation, and
the others release nothing; at the end everything is free."""

from __future__ import annotations

import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import TransferTimeout
from kvtier.lease import CallbackHold, LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.buffer import PDBuffer, TooLarge
from kvtier.pd.channels.base import checksum
from kvtier.pd.channels.tcp import TcpReceiver
from kvtier.pd.reservation import Reservation
from tests.storage.tier_contract import PAGE_BYTES, TOKEN_BYTES

KEYS = [os.urandom(16) for _ in range(7)]
PAGES = 4


class ReceiveBuffer(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = PDBuffer(PAGES, PAGE_BYTES, TOKEN_BYTES, TcpReceiver())
        self.tier.open()
        self.leases = LeaseTable(BlockPool(1, 64))
        self.live: dict[str, Reservation] = {}  # request -> its reservation
        self.pending: dict[str, list[int]] = {}  # request -> pages its sender has yet to fill
        self.claimed: set[str] = set()  # requests the decoder looked up (never expire)
        self.expired: set[str] = set()  # requests whose lease the expiry ended
        self.next_id = 0

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def reserve(self, keys: list[bytes]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            res, _ = self.tier.reserve(rid, keys, [16] * len(keys), timeout=0.0)
        except (TransferTimeout, TooLarge):
            return
        self.leases.join(rid).take_hold(res)  # the receiver acts for the request: unclaimed
        self.live[rid] = res
        self.pending[rid] = list(res.new)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data(), good=st.booleans())
    def receive(self, data: st.DataObject, good: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, p in self.pending.items() if p)))
        page = self.pending[rid].pop(0)
        res = self.live[rid]
        if not res.released:  # a released page may belong to another request by now
            payload = torch.full((PAGE_BYTES,), self.next_id % 251, dtype=torch.uint8)
            self.tier.page_view(page, PAGE_BYTES).copy_(payload)
            expected = checksum(payload) if good else checksum(payload) ^ 1
        else:
            expected = 0
        # A reservation that expired (or was aborted) mid-transfer publishes nothing.
        assert self.tier.publish(res, page, expected) is (good and not res.released)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def lookup_pin(self, data: st.DataObject, key: bytes) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        lease = self.leases.open(rid)  # the request itself: its lease no longer expires
        self.claimed.add(rid)
        self.expired.discard(rid)  # after an expiry, a lookup starts the request over
        if self.tier.pin(key):
            tier = self.tier
            lease.take_hold(CallbackHold(0, "pin", lambda: tier.unpin(key)))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        free = self.tier.pool.free_pages
        assert self.leases.end(rid) is (rid not in self.expired)
        assert not self.leases.end(rid)  # a second end is a no-op
        if rid in self.expired:
            assert self.tier.pool.free_pages == free  # the expiry gave it all back already
        del self.live[rid]
        self.pending.pop(rid, None)
        self.claimed.discard(rid)
        self.expired.discard(rid)

    @rule()
    def expire_unclaimed(self) -> None:
        """Every request the decoder has not looked up expires (a TTL of zero)."""
        expired = set(self.leases.expire_unclaimed(0.0))
        assert expired == {r for r in self.live if r not in self.claimed and r not in self.expired}
        assert all(self.live[r].released for r in expired)
        self.expired |= expired

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def abort_or_sender_death(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        free = self.tier.pool.free_pages
        was_released = self.live[rid].released
        self.live[rid].release()  # the request lives on; its lease's release is now a no-op
        self.live[rid].release()
        if was_released:  # expired first: this release gave nothing back
            assert self.tier.pool.free_pages == free
        del self.pending[rid]

    @invariant()
    def every_page_is_free_or_owned(self) -> None:
        expected: dict[int, int] = {}
        for res in self.live.values():
            if not res.released:
                for page in res.pages:
                    expected[page] = expected.get(page, 0) + 1
        assert self.tier.check_invariants(expected) == []

    def teardown(self) -> None:
        self.leases.end_all()
        assert self.tier.pool.free_pages == PAGES
        assert self.tier.usage().entries == 0
        self.tier.close()


ReceiveBuffer.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestReceiveBuffer = ReceiveBuffer.TestCase
