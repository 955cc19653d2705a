"""Per-tenant shares of the PD receive buffer (kvtier.pd.tenant_shares).

Hypothesis drives a receive buffer with ``tenant_quotas`` through reserve / receive / lookup
pin / end / abort or sender death / expiry of unclaimed requests / a limit changed at run
time, in any order, with keys taken from a counter per tenant (so a replayed case holds the
same keys). After every step each tenant is charged exactly the pages its live reservations
hold, and never more than the limit in force when its latest reservation was made; a
reservation is refused exactly when it would take its row past its share (the salts under
"*" together); at the end every charge is zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.config.tenant_quotas import MAX_TENANTS, parse_limit
from kvtier.errors import TransferTimeout
from kvtier.lease import CallbackHold, LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.buffer import PDBuffer
from kvtier.pd.channels.base import checksum
from kvtier.pd.channels.tcp import TcpReceiver
from kvtier.pd.reservation import Reservation, live_reservations
from kvtier.pd.tenant_shares import ShareTooSmall, TenantShares
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.rows import rows_dict
from tests.pd.test_buffer import PrefillerFedBuffer
from tests.storage.tenant_contract import TenantContract, TenantTierFactory
from tests.storage.tier_contract import PAGE_BYTES, TOKEN_BYTES

PAGES = 8
TENANTS = ["alice", "bob", "", "carol", "dave"]  # carol, dave: no row, they share "*"
KEYS_PER_TENANT = 5
LIMITS = ["25%", "50%", "100%", f"{3 * PAGE_BYTES}B", f"{PAGE_BYTES // 2}B", None]


def key_of(tenant: int, i: int) -> bytes:
    """The i-th key of tenant number ``tenant``: from counters, never random."""
    return bytes([tenant]) + i.to_bytes(15, "big")


def report_of(tier: PDBuffer) -> dict[str, dict[str, int | None]]:
    """The buffer's tenant rows, as stats() reports them."""
    assert tier.tenants is not None
    return rows_dict(tier.tenants.rows())


def buffer_with(rows: dict[str, str]) -> tuple[PDBuffer, TenantQuotas]:
    quotas = TenantQuotas({t: parse_limit("tenant_quotas", v) for t, v in rows.items()})
    tier = PDBuffer(PAGES, PAGE_BYTES, TOKEN_BYTES, TcpReceiver())
    tier.attach_quotas(quotas)
    tier.open()
    return tier, quotas


class TenantShareMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        rows = {"alice": "25%", "bob": "50%", "*": f"{2 * PAGE_BYTES}B", "": "50%"}
        self.tier, self.quotas = buffer_with(rows)
        self.leases = LeaseTable(BlockPool(1, 64))
        self.live: dict[str, Reservation] = {}
        self.pending: dict[str, list[int]] = {}
        self.claimed: set[str] = set()
        self.expired: set[str] = set()
        # tenant -> its share in pages when its latest reservation was made (None: no limit)
        self.latest_limit: dict[str, int | None] = {}
        self.next_id = 0

    def limit(self, tenant: str) -> int | None:
        return self.tier.shares.limit_pages(tenant)

    @rule(
        tenant=st.sampled_from(range(len(TENANTS))),
        picks=st.lists(st.integers(0, KEYS_PER_TENANT - 1), min_size=1, max_size=4, unique=True),
    )
    def reserve(self, tenant: int, picks: list[int]) -> None:
        name = TENANTS[tenant]
        keys = [key_of(tenant, i) for i in picks]
        rid = f"r{self.next_id}"
        self.next_id += 1
        limit, before = self.limit(name), self.tier.shares.held(name)
        row_before = self.tier.shares.row_held(name)  # under "*": every unnamed salt's
        free = self.tier.pool.free_pages
        try:
            res, _ = self.tier.reserve(rid, keys, [16] * len(keys), 0.0, name)
        except ShareTooSmall:
            assert limit is not None and len(keys) > limit  # refused at once: never fits
            return
        except TransferTimeout as exc:
            over = limit is not None and row_before + len(keys) > limit
            # Refused for its share exactly when it would pass it; otherwise only for room.
            assert ("tenant_quotas" in str(exc)) is over
            assert over or free < len(keys)
            assert self.tier.shares.held(name) == before  # a refusal charges nothing
            return
        assert limit is None or row_before + len(keys) <= limit
        assert self.tier.shares.held(name) == before + len(keys)
        assert self.tier.shares.row_held(name) == row_before + len(keys)
        self.latest_limit[name] = limit
        self.leases.join(rid).take_hold(res)
        self.live[rid] = res
        self.pending[rid] = list(res.new)

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data(), good=st.booleans())
    def receive(self, data: st.DataObject, good: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, p in self.pending.items() if p)))
        page = self.pending[rid].pop(0)
        res = self.live[rid]
        expected = 0
        if not res.released:
            payload = torch.full((PAGE_BYTES,), self.next_id % 251, dtype=torch.uint8)
            self.tier.page_view(page, PAGE_BYTES).copy_(payload)
            expected = checksum(payload) if good else checksum(payload) ^ 1
        assert self.tier.publish(res, page, expected) is (good and not res.released)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), tenant=st.sampled_from(range(len(TENANTS))), i=st.integers(0, 4))
    def lookup_pin(self, data: st.DataObject, tenant: int, i: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        lease = self.leases.open(rid)
        self.claimed.add(rid)
        self.expired.discard(rid)
        key = key_of(tenant, i)
        if self.tier.pin(key):
            tier = self.tier
            lease.take_hold(CallbackHold(0, "pin", lambda: tier.unpin(key)))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.leases.end(rid)
        assert not self.leases.end(rid)
        del self.live[rid]
        self.pending.pop(rid, None)
        self.claimed.discard(rid)
        self.expired.discard(rid)

    @rule()
    def expire_unclaimed(self) -> None:
        self.expired |= set(self.leases.expire_unclaimed(0.0))

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def abort_or_sender_death(self, data: st.DataObject) -> None:
        """What the receiver does when the sender aborts, dies or times out mid-transfer."""
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        self.live[rid].release()
        self.live[rid].release()  # a second release gives nothing back twice
        del self.pending[rid]

    @rule(tenant=st.sampled_from(["alice", "bob", "", "*"]), raw=st.sampled_from(LIMITS))
    def change_limit(self, tenant: str, raw: str | None) -> None:
        """``PUT /quota`` at run time: takes nothing from reservations already made."""
        held = {t: self.tier.shares.held(t) for t in TENANTS}
        self.quotas.set(tenant, None if raw is None else parse_limit("limit", raw))
        assert {t: self.tier.shares.held(t) for t in TENANTS} == held

    @invariant()
    def charges_match_reservations(self) -> None:
        live = live_reservations(self.leases, self.tier)
        assert self.tier.shares.check_against(live) == []
        assert self.tier.check_invariants() == []
        for tenant in TENANTS:
            limit = self.latest_limit.get(tenant)
            if tenant in self.latest_limit and limit is not None:
                assert self.tier.shares.held(tenant) <= limit

    def teardown(self) -> None:
        self.leases.end_all()
        report = report_of(self.tier)
        assert all(row["held_bytes"] == 0 and row["reservations"] == 0 for row in report.values())
        assert self.tier.pool.free_pages == PAGES
        self.tier.close()


TenantShareMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
TestTenantShares = TenantShareMachine.TestCase


def test_a_tenant_at_its_share_waits_and_goes_through_when_its_own_request_ends() -> None:
    tier, _ = buffer_with({"alice": "25%"})  # 2 of 8 pages
    try:
        first, _ = tier.reserve("a1", [key_of(0, 0), key_of(0, 1)], [16, 16], 0.0, "alice")
        got: list[Reservation] = []
        waiter = threading.Thread(
            target=lambda: got.append(tier.reserve("a2", [key_of(0, 2)], [16], 5.0, "alice")[0])
        )
        waiter.start()
        time.sleep(0.2)
        assert not got  # backpressure: waiting for alice's own pages, not failing
        bob, _ = tier.reserve("b1", [key_of(1, 0)], [16], 0.0, "bob")  # not held back
        first.release()
        waiter.join(5.0)
        assert len(got) == 1 and tier.shares.held("alice") == 1
        report = report_of(tier)
        assert report["alice"]["share_waits"] == 1 and report["alice"]["share_refusals"] == 0
        assert report["alice"]["limit_bytes"] == 2 * PAGE_BYTES
        assert report["bob"]["limit_bytes"] is None  # no row, no "*": no limit
        got[0].release()
        bob.release()
        assert tier.shares.held("alice") == tier.shares.held("bob") == 0
    finally:
        tier.close()


WAIT_S = 30.0  # the waiter's own deadline: reaching it would not be a wake-up
WOKEN_WITHIN_S = 2.0


@pytest.mark.parametrize(
    ("tenant", "row", "raised"),
    [
        ("alice", "alice", "50%"),  # its own row raised
        ("carol", "*", "50%"),  # the row of every tenant the table does not name, raised
        ("carol", "*", None),  # ... removed: no limit at all
    ],
)
def test_a_changed_limit_wakes_a_waiting_reservation_at_once(
    tenant: str, row: str, raised: str | None
) -> None:
    """A limit raised at run time lets a waiter through now, not at its deadline (the
    reservation would go through then anyway: it checks its share once more before failing)."""
    tier, quotas = buffer_with({"alice": "25%", "*": "25%"})  # 2 of 8 pages each
    got: list[Reservation] = []
    waiter = threading.Thread(
        target=lambda: got.append(tier.reserve("a2", [key_of(0, 2)], [16], WAIT_S, tenant)[0]),
        daemon=True,
    )
    try:
        first, _ = tier.reserve("a1", [key_of(0, 0), key_of(0, 1)], [16, 16], 0.0, tenant)
        waiter.start()
        deadline = time.monotonic() + WOKEN_WITHIN_S
        while report_of(tier)[tenant]["share_waits"] == 0:  # it is waiting now
            assert time.monotonic() < deadline, "the reservation never waited"
            time.sleep(0.01)
        changed = time.monotonic()
        quotas.set(row, None if raised is None else parse_limit("limit", raised))
        waiter.join(WOKEN_WITHIN_S)
        woken_after = time.monotonic() - changed
        assert not waiter.is_alive(), f"still waiting {woken_after:.1f}s after the change"
        assert len(got) == 1 and tier.shares.held(tenant) == 3
        first.release()
        got[0].release()
    finally:
        tier.close()
        if waiter.is_alive():  # it missed the wake: the buffer's close ends its wait
            waiter.join(WAIT_S)


def test_salts_under_the_star_row_share_one_share_and_leave_a_named_tenant_its_own() -> None:
    """A client that sends a new cache_salt with each request gets the "*" row once: its
    salts together hold at most 2 of the 8 pages, and alice still reserves her 4."""
    tier, _ = buffer_with({"alice": "50%", "*": "25%"})
    held: list[Reservation] = []
    try:
        for n in range(2):
            held.append(tier.reserve(f"s{n}", [key_of(2, n)], [16], 0.0, f"salt{n}")[0])
        for n in range(2, 8):  # each a salt of its own: per salt, each would have its 2 pages
            with pytest.raises(TransferTimeout, match=r"salts under '\*' together hold 2"):
                tier.reserve(f"s{n}", [key_of(2, n)], [16], 0.0, f"salt{n}")
        assert tier.shares.row_held("salt7") == 2
        mine = [key_of(0, i) for i in range(4)]
        held.append(tier.reserve("alice", mine, [16] * 4, 0.0, "alice")[0])
        assert tier.shares.held("alice") == 4
        report = report_of(tier)
        assert report["salt0"]["limit_bytes"] == 2 * PAGE_BYTES  # the row each salt shares
        assert report["salt7"]["share_refusals"] == 1
    finally:
        for reservation in held:
            reservation.release()
        tier.close()


def test_refusals_name_the_tenant_its_share_and_what_to_change() -> None:
    tier, _ = buffer_with({"*": "25%"})
    try:
        with pytest.raises(ShareTooSmall, match=r"tenant 'x' needs 3 pages.*'\*': 25%.*2 of 8"):
            tier.reserve("big", [key_of(2, i) for i in range(3)], [16] * 3, 1.0, "x")
        held, _ = tier.reserve("r1", [key_of(2, 0), key_of(2, 1)], [16, 16], 0.0, "x")
        together = r"tenant 'x' holds 2 \(the salts under '\*' together hold 2\) of their 2 pages"
        with pytest.raises(TransferTimeout, match=together):
            tier.reserve("r2", [key_of(2, 3)], [16], 0.05, "x")
        assert report_of(tier)["x"]["share_refusals"] == 2
        held.release()
    finally:
        tier.close()


def test_without_quotas_nothing_is_charged_or_reported() -> None:
    tier = PDBuffer(PAGES, PAGE_BYTES, TOKEN_BYTES, TcpReceiver())
    tier.open()
    try:
        res, _ = tier.reserve("r", [key_of(0, i) for i in range(PAGES)], [16] * PAGES, 0.0, "a")
        assert tier.tenants is None and tier.shares.limit_pages("a") is None
        res.release()
    finally:
        tier.close()


def test_the_tenant_table_stays_bounded_when_peers_name_many_tenants() -> None:
    """Tenants come from peers: past MAX_TENANTS, tenants that hold nothing are forgotten,
    and a tenant that holds pages keeps its charge."""
    shares = TenantShares(PAGES, PAGE_BYTES)
    shares.take("keeper", 2)
    for i in range(MAX_TENANTS + 10):
        shares.take(f"t{i}", 1)
        shares.give_back(f"t{i}", 1)
    assert len(shares._use) <= MAX_TENANTS and shares.held("keeper") == 2
    with pytest.raises(AssertionError, match="3 pages given back, 2 held"):
        shares.give_back("keeper", 3)  # refused, never clamped


class TestPDBufferTenantContract(TenantContract):
    """The PD buffer fed as a prefiller feeds it (each put a reservation of its tenant's):
    a tenant at its share is refused (its transfer would wait), nothing is evicted."""

    unit_bytes = PAGE_BYTES
    evicts = False

    @pytest.fixture
    def tenant_tier(self) -> Iterator[TenantTierFactory]:
        made: list[PrefillerFedBuffer] = []

        def make(quotas: TenantQuotas) -> PrefillerFedBuffer:
            tier = PrefillerFedBuffer()
            tier.attach_quotas(quotas)
            tier.open()
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.clear()
            assert tier.pool.free_pages == 16
            tier.close()
