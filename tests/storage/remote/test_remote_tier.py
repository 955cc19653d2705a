"""A third remote store is only a store, a ledger and options: the tier contract, tenant
quotas and the outage window, run on :class:`RemoteTier` over a dict held in this module."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvtier.config.tenant_quotas import TenantLimit
from kvtier.errors import TierError, TierUnavailable
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage import record_reads, records
from kvtier.storage.base import Membership, PutOutcome, TierUsage
from kvtier.storage.remote.ledger import QuotaLedger
from kvtier.storage.remote.store import ObjectStore, RemoteCounters, Visible
from kvtier.storage.remote.tier import RemoteTier
from kvtier.storage.tenants.quotas import TenantQuotas
from tests.storage.remote.helpers import put_as, tenant_rows
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)

FINGERPRINT = Fingerprint("remote-dict", CONTRACT_LAYOUT, CONTRACT_CHUNK)
log = logging.getLogger(__name__)


class DictStore(ObjectStore):
    """The whole store: records in a dict, and a switch that makes every call fail."""

    name = "dict"
    log = log

    def __init__(self, fingerprint: Fingerprint, retry_after_s: float = 0.0) -> None:
        self.counters = RemoteCounters()
        self.fingerprint = fingerprint
        self.retry_after_s = retry_after_s
        self.values: dict[str, bytes] = {}
        self.calls = 0
        self.down = False  # every call raises TierUnavailable
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return "a dict in this test"

    def name_of(self, key: ChunkKey) -> str:
        return f"{self.fingerprint.hex()}/{key.hex()}"

    def _enter(self) -> None:
        self.calls += 1
        if self.down:
            raise TierUnavailable("the dict is away")

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        self._enter()
        value = self.values.get(self.name_of(key))
        if value is None:
            return None
        return record_reads.decode_record_into(memoryview(value), self.fingerprint, key, out)

    def put(self, key: ChunkKey, parts: Sequence[bytes | memoryview], then: Visible) -> None:
        self._enter()
        with self._lock:
            self.values[self.name_of(key)] = b"".join(bytes(p) for p in parts)
            then((key,))

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._enter()
        return [self.name_of(k) in self.values for k in keys]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._enter()
        with self._lock:
            return [self.values.pop(self.name_of(k), None) is not None for k in keys]

    def list_keys(self) -> list[ChunkKey]:
        self._enter()
        prefix = self.fingerprint.hex() + "/"
        return [bytes.fromhex(n[len(prefix) :]) for n in list(self.values) if n.startswith(prefix)]

    def usage(self) -> TierUsage:
        self._enter()
        used = sum(len(v) for v in self.values.values())
        return TierUsage(used, 1 << 30, len(self.values))


class DictLedger(QuotaLedger):
    """Each tenant's chunks, oldest first, kept here; a charge past the limit deletes the
    oldest from the store. ``refuse`` makes the next charge fail."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        read_capacity: Callable[[], int],
        store: DictStore,
    ) -> None:
        super().__init__(quotas, unit_bytes, read_capacity)
        self.store = store
        self.orders: dict[str, OrderedDict[ChunkKey, None]] = {}
        self.refuse = False

    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        if self.refuse:
            raise TierError("the ledger did not answer")
        tenant = self.counted_as(tenant)
        with self._lock:
            order = self.orders.setdefault(tenant, OrderedDict())
            order[key] = None
        return self._trim(tenant)

    def enforce_all(self) -> list[ChunkKey]:
        return [key for tenant in list(self.orders) for key in self._trim(tenant)]

    def _trim(self, tenant: str) -> list[ChunkKey]:
        limit = self.limit_chunks(tenant)
        with self._lock:
            order = self.orders[tenant]
            victims = []
            while limit is not None and len(order) > limit:
                victims.append(order.popitem(last=False)[0])
            held = len(order)
        self.store.delete_many(victims)
        self.updated(tenant, held, victims)
        return victims


@dataclass(frozen=True)
class DictOptions:
    put_threads: int = 2
    inflight_bytes: int = 64 << 20
    retry_after_s: float = 0.0


def dict_tier(options: DictOptions = DictOptions()) -> RemoteTier:
    """What a new store's tier module is: its store, its ledger and options, assembled."""
    store = DictStore(FINGERPRINT, options.retry_after_s)

    def ledger(quotas: TenantQuotas, unit: int, capacity: Callable[[], int]) -> DictLedger:
        return DictLedger(quotas, unit, capacity, store)

    return RemoteTier(store, CONTRACT_LAYOUT, FINGERPRINT, options, ledger=ledger)


class TestRemoteTierOverADict(TierContract):
    @pytest.fixture
    def tier(self) -> Iterator[RemoteTier]:
        tier = dict_tier()
        tier.open()
        yield tier
        tier.close()


def test_a_tenant_over_its_limit_loses_its_oldest_through_the_ledger() -> None:
    tier = dict_tier()
    unit = records.header_size() + CONTRACT_LAYOUT.payload_bytes(CONTRACT_CHUNK)
    tier.attach_quotas(TenantQuotas({"t": TenantLimit(nbytes=2 * unit)}))
    evicted: list[ChunkKey] = []
    tier.add_evict_listener(evicted.extend)
    tier.open()
    try:
        keys = [random_key() for _ in range(4)]
        for i, key in enumerate(keys):
            assert put_as(tier, "t", key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK).outcome is (
                PutOutcome.STORED
            )
        other = random_key()
        put_as(tier, "other", other, payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
        assert tier.contains([*keys, other]) == [False, False, True, True, True]
        assert evicted == keys[:2] and tier.counters.evicted == 2
        assert tier.tenants is not None
        assert tier.tenants.evicted_by_quota(keys) == dict.fromkeys(keys[:2], "t")
        assert tenant_rows(tier)["t"]["chunks"] == 2
    finally:
        tier.close()


def test_a_chunk_the_ledger_did_not_count_is_deleted_again() -> None:
    tier = dict_tier()
    tier.attach_quotas(TenantQuotas({"t": TenantLimit(nbytes=1 << 30)}))
    seen: list[tuple[Membership, list[ChunkKey]]] = []
    tier.add_membership_listener(lambda change, keys: seen.append((change, list(keys))))
    tier.open()
    try:
        assert isinstance(tier.ledger, DictLedger)
        tier.ledger.refuse = True
        key = random_key()
        result = put_as(tier, "t", key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.FAILED and "did not answer" in result.detail
        assert tier.contains([key]) == [False] and tier.counters.failed == 1
        assert seen == [(Membership.ADDED, [key]), (Membership.REMOVED, [key])]
    finally:
        tier.close()


def test_a_store_that_stops_answering_is_left_alone_for_its_retry_window() -> None:
    tier = dict_tier(DictOptions(retry_after_s=0.5))
    tier.open()
    try:
        key = random_key()
        assert put_and_wait(tier, key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK).outcome is (
            PutOutcome.STORED
        )
        store = tier.store
        assert isinstance(store, DictStore)
        store.down = True
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) is None  # the call that found it away
        calls = store.calls
        assert tier.get_into(key, out) is None  # the window: no call at all
        result = put_and_wait(tier, random_key(), payload(CONTRACT_CHUNK, 2), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.DROPPED and store.calls == calls
        tier.usage()
        assert tier.counters.outages == 1 and tier.counters.available == 0
        store.down = False
        time.sleep(0.6)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        assert torch.equal(out, payload(CONTRACT_CHUNK, 1))
    finally:
        tier.close()


def test_a_store_without_a_window_is_asked_again_at_once() -> None:
    """retry_after_s 0: the store says itself when it is away (a link reconnecting)."""
    tier = dict_tier()
    tier.open()
    try:
        store = tier.store
        assert isinstance(store, DictStore)
        store.down = True
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(random_key(), out) is None
        calls = store.calls
        assert tier.contains([random_key()]) == [False] and store.calls == calls + 1
        assert tier.counters.outages == 0  # the store's to count, not the tier's
    finally:
        tier.close()
