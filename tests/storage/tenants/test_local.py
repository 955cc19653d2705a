"""Per-tenant quotas in the CPU tier (``kvtier.storage.tenants.local``): a flooding tenant
stays within its limit, pins still hold (and count against their tenant), a tenant under
its guarantee keeps its chunks, a limit changed at run time applies at once; and a
hypothesis state machine over stores, pins, lookups and quota changes checks the accounting."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.config.tenant_quotas import TenantLimit, parse_tenant_quotas
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.cpu import CpuTier
from kvtier.storage.policy import POLICIES, make_policy
from kvtier.storage.tenants.local import TenantPolicy
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.reuse import MIN_WINDOW
from tests.storage.tenant_contract import TenantContract, TenantTierFactory
from tests.storage.tier_contract import CONTRACT_CHUNK, PAGE_BYTES, TOKEN_BYTES, random_key

PAGES = 12


def quota_tier(
    pool: BlockPool, rows: dict[str, object], policy: str = "LRU"
) -> tuple[CpuTier, TenantPolicy]:
    quotas = TenantQuotas(parse_tenant_quotas("tenant_quotas", rows))
    tenants = TenantPolicy(
        lambda: make_policy(policy), quotas, PAGE_BYTES, pool.num_pages * PAGE_BYTES
    )
    return CpuTier(pool, TOKEN_BYTES, tenants=tenants), tenants


def store(
    tier: CpuTier,
    tenant: str,
    count: int = 1,
    new_key: Callable[[], ChunkKey] = random_key,
) -> list[ChunkKey]:
    """``count`` new chunks of ``tenant``, as the manager stores them; the keys stored."""
    keys = []
    for _ in range(count):
        pages = tier.allocate(1)
        if pages is None:
            break
        key = new_key()
        if not tier.insert(key, pages[0], CONTRACT_CHUNK, tenant):
            tier.pool.release(pages)
        keys.append(key)
    return keys


@pytest.fixture(params=sorted(POLICIES))
def policy_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    pool = BlockPool(PAGES, PAGE_BYTES)
    yield pool
    pool.close()


def test_a_flooding_tenant_stays_within_its_quota(pool: BlockPool, policy_name: str) -> None:
    tier, tenants = quota_tier(pool, {"flood": "25%", "*": "75%"}, policy_name)
    quiet = store(tier, "quiet", 4)
    flood = store(tier, "flood", 40)
    assert tenants.held_bytes("flood") == 3 * PAGE_BYTES  # 25 % of 12 pages
    assert tier.contains(quiet) == [True] * 4  # the other tenant lost nothing
    assert tier.contains(flood[-3:]) == [True] * 3 and not any(tier.contains(flood[:-3]))
    usage = tenants.usage["flood"]
    assert usage.quota_evictions == usage.evictions == 37
    assert tenants.usage["quiet"].evictions == 0
    assert set(tenants.evicted_by_quota(flood).values()) == {"flood"}


def test_pinned_chunks_are_never_evicted_and_count_against_their_tenant(
    pool: BlockPool,
) -> None:
    tier, tenants = quota_tier(pool, {"t": "25%"})
    first = store(tier, "t", 3)
    pins = tier.pin_keys(first)  # a request's lease holds all three
    later = store(tier, "t", 2)
    assert tier.contains(first) == [True] * 3  # pinned: kept, although t is over now
    assert tier.contains(later) == [False, False]  # t's own unpinned chunks went instead
    assert tenants.held_bytes("t") == 3 * PAGE_BYTES
    pool.release([e.page for e in pins.values()])
    store(tier, "t", 1)  # unpinned now: t's next store brings it back within its limit
    assert tenants.held_bytes("t") == 3 * PAGE_BYTES


def test_a_tenant_under_its_guarantee_is_not_evicted_by_others(pool: BlockPool) -> None:
    tier, tenants = quota_tier(pool, {"a": "50%", "b": "50%"})
    a_keys = store(tier, "a", 5)  # under its 6 pages
    b_keys = store(tier, "b", 30)  # fills the tier: every victim is b's own
    assert tier.contains(a_keys) == [True] * 5
    assert tenants.usage["a"].evictions == 0
    assert tenants.held_bytes("b") <= 6 * PAGE_BYTES
    assert tier.contains(b_keys[-6:]) == [True] * 6


def test_unnamed_tenants_share_one_order_and_are_evicted_before_a_guarantee(
    pool: BlockPool,
) -> None:
    tier, tenants = quota_tier(pool, {"vip": "50%"})  # no "*": others have no limit
    vip = store(tier, "vip", 6)
    for n in range(10):
        store(tier, f"guest{n}", 2)  # 20 chunks into the 6 pages the vip leaves
    assert tier.contains(vip) == [True] * 6
    assert sum(tenants.held_bytes(f"guest{n}") for n in range(10)) == 6 * PAGE_BYTES
    assert tenants.limit_bytes("guest0") is None


def test_a_tenant_whose_chunks_do_not_come_back_loses_its_guarantee(pool: BlockPool) -> None:
    """Rule 3: a scanner under a 50 % quota keeps it while it is used; once it has lost a
    window of chunks unused its never-hit chunks go first, and it keeps its hot one."""
    tier, tenants = quota_tier(pool, {"scan": "50%"})
    hot = store(tier, "scan", 1)
    for _ in range(MIN_WINDOW + 6):  # each scan hits the hot chunk, then reads a new one
        pool.release([e.page for e in tier.pin_keys(hot).values()])
        store(tier, "scan", 1)
    assert not tenants.guarantee_held("scan")
    assert {r.tenant: r for r in tenants.rows()}["scan"].guarantee_bytes == 0
    chat = store(tier, "chat", PAGES - 1)  # no row: without rule 3 it could keep only 6
    assert tier.contains(chat) == [True] * (PAGES - 1)
    assert tier.contains(hot) == [True]  # the chunk it uses is the one it keeps
    assert tenants.held_bytes("scan") == PAGE_BYTES


def test_a_lapsed_tenant_whose_chunk_comes_back_regains_its_guarantee(pool: BlockPool) -> None:
    tier, tenants = quota_tier(pool, {"t": "50%"})
    keys = store(tier, "t", MIN_WINDOW + 6)
    assert not tenants.guarantee_held("t")
    lost = keys[-7]  # among the last window lost: still a ghost
    assert tier.contains([lost]) == [False]
    store(tier, "t", 1, lambda: lost)  # asked for again: its chunks do come back
    assert tenants.guarantee_held("t")
    assert {r.tenant: r for r in tenants.rows()}["t"].guarantee_bytes == 6 * PAGE_BYTES
    others = store(tier, "other", PAGES)
    assert tenants.held_bytes("t") == 6 * PAGE_BYTES  # its guarantee holds again
    assert tier.contains(others[-6:]) == [True] * 6


def test_a_quota_changed_at_run_time_applies_at_once(pool: BlockPool) -> None:
    tier, tenants = quota_tier(pool, {"*": "100%"})
    keys = store(tier, "t", 8)
    tenants.quotas.set("t", TenantLimit(nbytes=2 * PAGE_BYTES))
    assert tenants.held_bytes("t") == 2 * PAGE_BYTES
    assert tier.contains(keys) == [False] * 6 + [True] * 2  # its oldest went
    assert tenants.usage["t"].quota_evictions == 6
    tenants.quotas.set("t", None)  # back to the "*" row
    assert tenants.limit_bytes("t") == PAGES * PAGE_BYTES
    tier.close()


def test_a_tenant_that_gains_a_row_moves_out_of_the_shared_order(pool: BlockPool) -> None:
    tier, tenants = quota_tier(pool, {"other": "10%"})
    keys = store(tier, "t", 4)  # no row: in the shared order
    pins = tier.pin_keys(keys[:3])
    tenants.quotas.set("t", TenantLimit(nbytes=2 * PAGE_BYTES))
    assert tier.contains(keys) == [True, True, True, False]  # the pins held; the rest went
    assert tenants.held_bytes("t") == 3 * PAGE_BYTES  # over by what it has pinned
    pool.release([e.page for e in pins.values()])  # the lease gives the pages back
    store(tier, "t", 1)
    assert tenants.held_bytes("t") == 2 * PAGE_BYTES


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"a": "25%"}, {"a": TenantLimit(share=0.25)}),
        ({"*": "1KiB", "": 2}, {"*": TenantLimit(nbytes=1024), "": TenantLimit(nbytes=2 << 30)}),
        (None, {}),
    ],
)
def test_the_config_key_reads_sizes_and_shares(raw: object, expected: object) -> None:
    assert parse_tenant_quotas("tenant_quotas", raw) == expected


@pytest.mark.parametrize(
    "raw", [{"a": "0%"}, {"a": "101%"}, {"a": "lots"}, {"a": -1}, ["a"], {1: "1GiB"}]
)
def test_a_bad_quota_names_the_key_and_what_is_valid(raw: object) -> None:
    with pytest.raises(ConfigError, match="tenant_quotas") as caught:
        parse_tenant_quotas("tenant_quotas", raw)
    assert "share" in str(caught.value) or "cache_salt" in str(caught.value)


# -- the accounting, as a state machine ----------------------------------------------------
TENANTS = ("a", "b", "c", "")
PAGES_IN_MACHINE = 8


class TenantAccounting(RuleBasedStateMachine):
    """Stores of several tenants, pins and their release, lookups, run-time quota changes,
    against a tier of a few pages. After every step: each tenant's bytes are never negative
    and equal the chunks the tier holds for it; and right after a tenant stores (or its
    limit changes), its row (its own, or "*" shared by every salt the table does not name)
    is within its limit unless every chunk held under that row is pinned."""

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def open(self, policy: str) -> None:
        self.pool = BlockPool(PAGES_IN_MACHINE, PAGE_BYTES)
        self.tier, self.tenants = quota_tier(self.pool, {"a": "25%", "*": "50%"}, policy)
        self.owner: dict[ChunkKey, str] = {}
        self.pins: list[tuple[ChunkKey, int]] = []
        self.stores = 0

    def next_key(self) -> ChunkKey:
        """Keys from a counter, not random: the policy's order (and so which keys are held
        for the next rule to draw from) must be the same each time hypothesis replays a case."""
        self.stores += 1
        return hashlib.blake2b(self.stores.to_bytes(8, "big"), digest_size=16).digest()

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            self.pool.release([page for _, page in self.pins])
            self.tier.close()
            assert self.pool.free_pages == self.pool.num_pages
            self.pool.close()

    @rule(tenant=st.sampled_from(TENANTS), count=st.integers(1, 4))
    def store(self, tenant: str, count: int) -> None:
        for key in store(self.tier, tenant, count, self.next_key):
            self.owner[key] = tenant
        self.check_within_limit([tenant])

    @rule(tenant=st.sampled_from(TENANTS), data=st.data())
    def pin(self, tenant: str, data: st.DataObject) -> None:
        held = [k for k, t in self.owner.items() if t == tenant and self.tier.contains([k])[0]]
        if held:
            key = data.draw(st.sampled_from(held))
            self.pins += [(k, e.page) for k, e in self.tier.pin_keys([key]).items()]

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.pins:
            index = data.draw(st.integers(0, len(self.pins) - 1))
            _, page = self.pins.pop(index)
            self.pool.release([page])

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        keys = [k for k in self.owner if self.tier.contains([k])[0]]
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.pool.release([e.page for e in self.tier.pin_keys([key]).values()])

    @rule(
        tenant=st.sampled_from(TENANTS),
        limit=st.one_of(st.none(), st.integers(1, 8).map(lambda n: TenantLimit(share=n / 8))),
    )
    def set_quota(self, tenant: str, limit: TenantLimit | None) -> None:
        self.tenants.quotas.set(tenant, limit)
        self.check_within_limit(TENANTS)

    def check_within_limit(self, tenants: tuple[str, ...] | list[str]) -> None:
        pinned = {key for key, _ in self.pins}
        row_of = self.tenants.quotas.row_of
        for tenant in tenants:
            limit = self.tenants.limit_bytes(tenant)
            sharing = [t for t in TENANTS if row_of(t) == row_of(tenant)]
            held = sum(self.tenants.held_bytes(t) for t in sharing)
            if limit is not None and held > limit:
                its = [
                    k for k, t in self.owner.items() if t in sharing and self.tier.contains([k])[0]
                ]
                assert set(its) <= pinned, f"{tenant!r}'s row over its limit, unpinned chunks"

    @invariant()
    def bytes_held_equal_the_chunks_held(self) -> None:
        if not hasattr(self, "tier"):
            return
        for tenant in TENANTS:
            held = self.tenants.held_bytes(tenant)
            chunks = sum(
                1 for k, t in self.owner.items() if t == tenant and self.tier.contains([k])[0]
            )
            assert held >= 0
            assert held == chunks * PAGE_BYTES
        assert len(self.tenants) == len(self.tier)
        row_of = self.tenants.quotas.row_of
        for row, watch in self.tenants._watch.items():  # no key outlives its chunk there
            held = {
                k for k, t in self.owner.items() if row_of(t) == row and self.tier.contains([k])[0]
            }
            assert watch._hit <= held
            assert len(watch._ghosts) <= watch.window
        # the guarantees' scale, kept as chunks come and go, is what a fresh sum gives: one
        # limit per row held, however many salts share "*"
        limits = {
            row_of(t): self.tenants.limit_bytes(t)
            for t, u in self.tenants.usage.items()
            if u.chunks
        }
        total = sum(x for x in limits.values() if x is not None)
        for tenant in TENANTS:
            limit = self.tenants.limit_bytes(tenant)
            usage = self.tenants.usage.get(tenant)
            if limit is not None and usage is not None and usage.chunks:
                assert self.tenants.guarantee_bytes(tenant) <= limit
                expected = limit * min(1.0, PAGES_IN_MACHINE * PAGE_BYTES / total)
                assert self.tenants.guarantee_bytes(tenant) == pytest.approx(expected)


TestTenantAccounting = TenantAccounting.TestCase
TestTenantAccounting.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_tenants_that_hold_nothing_are_forgotten_past_a_bound(
    pool: BlockPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvtier.storage.tenants.local.TENANTS_KEPT", 5)
    tier, tenants = quota_tier(pool, {"*": "100%"})
    for n in range(40):  # a salt per user: 40 tenants through a tier of 12 pages
        store(tier, f"user{n}", 1)
    assert len(tenants.usage) == PAGES  # the twelve holding a chunk; the others forgotten
    assert len(tenants) == len(tier) == PAGES
    assert sum(u.chunks for u in tenants.usage.values()) == PAGES


# -- the "*" row: one guarantee for every salt it covers -----------------------------------
SPRAY_PAGES = 100


@settings(max_examples=20, deadline=None)
@example(salts=200, chunks_each=1, default=10)  # the finding: alice kept 4 of 50
@given(salts=st.integers(2, 220), chunks_each=st.integers(1, 3), default=st.integers(1, 45))
def test_salts_under_the_star_row_cannot_shrink_a_named_guarantee(
    salts: int, chunks_each: int, default: int
) -> None:
    """A client that sprays salts (vLLM takes ``cache_salt`` from each request) stores under
    the ``"*"`` row once, whatever the number of salts: alice's 50 % stays hers. (The rows
    add up to under 100 %: at exactly 100 % a full tier breaks a tie of two groups each at
    its guarantee by order, which one flooding salt meets as well.)"""
    pool = BlockPool(SPRAY_PAGES, PAGE_BYTES)
    try:
        tier, tenants = quota_tier(pool, {"alice": "50%", "*": f"{default}%"})
        alice = store(tier, "alice", 50)
        for n in range(salts):
            store(tier, f"spray{n}", chunks_each)
        assert tier.contains(alice) == [True] * 50
        assert tenants.guarantee_bytes("alice") == 50 * PAGE_BYTES
        pooled = sum(tenants.held_bytes(f"spray{n}") for n in range(salts))
        assert pooled <= default * PAGE_BYTES  # the salts' sum is capped by the one row
        star = tenants.limit_bytes("*")  # one guarantee, all of the row, for all the salts
        assert tenants.guarantee_bytes("spray0") == tenants.guarantee_bytes("spray1") == star
        tier.close()
    finally:
        pool.close()


class TestCpuTenantContract(TenantContract):
    unit_bytes = PAGE_BYTES

    @pytest.fixture
    def tenant_tier(self) -> Iterator[TenantTierFactory]:
        made: list[CpuTier] = []

        def make(quotas: TenantQuotas) -> CpuTier:
            pool = BlockPool(16, PAGE_BYTES)
            ledger = TenantPolicy(lambda: make_policy("LRU"), quotas, PAGE_BYTES, 16 * PAGE_BYTES)
            tier = CpuTier(pool, TOKEN_BYTES, tenants=ledger)
            tier.open()
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()
            assert tier.pool.free_pages == tier.pool.num_pages
            tier.pool.close()
