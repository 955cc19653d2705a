"""The CPU tier: an index of chunk keys to pages of the block pool, evicted by a policy.

Each cached entry owns exactly one reference to its page. Requests that hit an entry take
their own reference (held by their lease), so an entry can be dropped from the index while a
request still reads its page: the page is freed only when the last reference goes.
Which entries go, and which chunks are kept at all, is the eviction policy's choice
(``kvtier.storage.policy``, ``cache_policy``); the tier tells it which entries are evictable:
those whose page has no reference besides the cache's own (not pinned by a request, not
being written to a lower tier). Reference counts never reach the policy.

An entry the policy finds held leaves its order until it is evictable again
(``kvtier.storage.policy.base``: "Held keys"), so pinned entries cost an eviction nothing.
The tier cannot say when that is for most references: a lease and a lower-tier write give
theirs back to the pool directly, and the pool stays the one owner of the counts. So the
policy looks at a few held entries again at each eviction; only a pin by key (``pin`` /
``unpin``), which goes through the tier, brings its entry back at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from kvtier.keys import ChunkKey
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import OnDone, PutOutcome, PutResult, Tier, TierUsage
from kvtier.storage.key_pins import KeyPins
from kvtier.storage.policy import EvictionPolicy, LruPolicy
from kvtier.storage.policy.tenants import TenantPolicy


@dataclass(slots=True, eq=False)  # identity: pin_prefix finds None among entries in C
class CpuEntry:
    page: int
    num_tokens: int
    nbytes: int


_PAGE_OF = attrgetter("page")


class CpuTier(Tier):
    name = "cpu"
    medium = "CPU"
    # An entry is a page of the pool, served from it with no copy. False for a CPU tier
    # through a codec (kvtier.storage.cpu_coded): the manager loads it like a lower tier.
    resident = True

    def __init__(
        self,
        pool: BlockPool,
        token_bytes: int | Callable[[int], int],
        policy: EvictionPolicy | None = None,
    ) -> None:
        """``token_bytes``: bytes per token, or a chunk's payload bytes by its token count
        (``KVLayout.payload_bytes``, when a KV-cache group stores fewer tokens).
        ``policy``: the eviction policy (a fresh one per tier; default plain LRU)."""
        super().__init__()
        self.pool = pool
        if callable(token_bytes):
            self._payload = token_bytes
        else:
            per_token = token_bytes
            self._payload = lambda n: n * per_token
        self._index: dict[ChunkKey, CpuEntry] = {}
        self.policy = policy if policy is not None else LruPolicy()
        self._lock = threading.RLock()
        # Key-level pins (the Tier interface); each holds one page reference. The engine's own
        # requests pin through pin_keys and their leases instead.
        self._key_pins = KeyPins()
        # Eviction and membership listeners (Tier) are called under the lock.
        if isinstance(self.policy, TenantPolicy):  # tenant_quotas: a changed row applies now
            self.policy.quotas.subscribe(self.apply_quotas)

    # -- page-level API used by the storage manager ----------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages with one reference each for the caller, evicting entries that
        nobody else holds (the policy's victims) when the pool is short. None when even
        that cannot make room."""
        with self._lock:
            pages = self.pool.allocate(count)
            if pages is None:
                self._evict(count - self.pool.free_pages)
                pages = self.pool.allocate(count)
            return pages

    def insert(self, key: ChunkKey, page: int, num_tokens: int, tenant: str | None = None) -> bool:
        """Cache ``page`` under ``key``, taking over the caller's reference to it.

        Returns False (and takes nothing) when ``key`` is already cached or the policy declines
        it (``EvictionPolicy.admit``): the caller keeps its reference and must release it.
        First writer wins; a duplicate never takes a reference nobody would give back.
        ``tenant``: the storing request's ``cache_salt``; with ``tenant_quotas`` a tenant
        over its limit then drops its own victims (maybe this chunk: it stays inserted, its
        reference taken over, and is evicted as any other).
        """
        with self._lock:
            if key in self._index:
                self.policy.touch([key])
                return False
            tenants = self.policy if isinstance(self.policy, TenantPolicy) else None
            if tenants is not None:
                tenants.assign(key, tenant)
            if not self.policy.admit(key, num_tokens):
                self.counters.dropped += 1
                return False
            nbytes = self._payload(num_tokens)
            self._index[key] = CpuEntry(page, num_tokens, nbytes)
            self.policy.insert(key)
            self.counters.stored += 1
            self.counters.bytes_written += nbytes
            self.report_added((key,))
            if tenants is not None and tenants.over_quota(tenant or ""):
                self._drop(tenants.evict_over_quota(tenant or "", self._evictable))
            return True

    def enforce_quota(self, tenant: str | None) -> None:
        """Bring ``tenant`` back within its limit now (after a store has let go of its new
        chunks' pages, which no eviction could take while it held them). Without quotas,
        or within its limit, nothing."""
        tenants = self.policy
        if isinstance(tenants, TenantPolicy) and tenants.over_quota(tenant or ""):
            with self._lock:
                self._drop(tenants.evict_over_quota(tenant or "", self._evictable))

    def apply_quotas(self) -> None:
        """The quota table changed: tenants move between orders, and each one now over its
        limit drops its own victims."""
        tenants = self.policy
        assert isinstance(tenants, TenantPolicy)
        with self._lock:
            tenants.regroup()
            for tenant in list(tenants.usage):
                if tenants.over_quota(tenant):
                    self._drop(tenants.evict_over_quota(tenant, self._evictable))

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, CpuEntry]:
        """The cached entries among ``keys``, each with one new page reference for the caller
        (its lease to hold), marked most recently used. Atomic with respect to eviction."""
        found: dict[ChunkKey, CpuEntry] = {}
        with self._lock:
            index = self._index
            for key in keys:
                entry = index.get(key)
                if entry is not None and key not in found:
                    found[key] = entry
            self.policy.touch(list(found))
            self.pool.retain(e.page for e in found.values())
        return found

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pages of the longest prefix of ``keys`` that is cached, each with one new reference
        for the caller (its lease to hold), marked most recently used. Atomic with respect to
        eviction. Every step is a C-level loop (``map``): no Python per chunk, as a lookup of
        a long cached prompt pins hundreds of chunks."""
        with self._lock:
            index = self._index
            found = list(map(index.get, keys))
            if not all(found):  # entries are always true: all() stops at the first miss
                found = found[: found.index(None)]
            if not found:
                return []
            self.policy.touch(keys[: len(found)])
            pages: list[int] = list(map(_PAGE_OF, found))
            self.pool.retain(pages)
        return pages

    def make_room(self, chunks: int) -> None:
        """Nothing: ``allocate`` evicts for a page (a coded tier evicts here for its slots)."""
        return None

    def entries(self, keys: Sequence[ChunkKey]) -> list[CpuEntry | None]:
        with self._lock:
            return [self._index.get(k) for k in keys]

    def _evict(self, needed: int) -> int:
        if needed <= 0:
            return 0
        return self._drop(self.policy.evict(needed, self._evictable))

    def _evictable(self, key: ChunkKey) -> bool:
        return not self.pool.is_shared(self._index[key].page)

    def _drop(self, victims: list[ChunkKey]) -> int:
        """Drop the policy's ``victims`` (forgotten there already) and free their pages."""
        if not victims:
            return 0
        pages = [self._index.pop(key).page for key in victims]
        self.pool.release(pages)
        self.counters.evicted += len(pages)
        self.report_evicted(victims)
        return len(pages)

    def page_tensor(self, entry: CpuEntry) -> torch.Tensor:
        return self.pool.page_bytes_view(entry.page, entry.nbytes)

    def owned_pages(self) -> set[int]:
        with self._lock:
            return {e.page for e in self._index.values()}

    # -- the common tier interface -----------------------------------------------------------
    def open(self) -> None:
        return None

    def close(self) -> None:
        if isinstance(self.policy, TenantPolicy):
            self.policy.quotas.unsubscribe(self.apply_quotas)
        self.clear(force=True)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.counters.misses += 1
                return None
            self.pool.retain([entry.page])
        try:
            out[: entry.nbytes].copy_(self.page_tensor(entry))
        finally:
            self.pool.release([entry.page])
        self.counters.hits += 1
        self.counters.bytes_read += entry.nbytes
        return entry.num_tokens

    def put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        if self.contains([key])[0]:
            on_done(PutResult(key, PutOutcome.EXISTS))
            return
        pages = self.allocate(1)
        if pages is None:
            self.counters.dropped += 1
            on_done(PutResult(key, PutOutcome.DROPPED, "no evictable page"))
            return
        self.pool.page_bytes_view(pages[0], payload.numel()).copy_(payload)
        if not self.insert(key, pages[0], num_tokens):
            self.pool.release(pages)
            on_done(PutResult(key, PutOutcome.EXISTS))
            return
        on_done(PutResult(key, PutOutcome.STORED))

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            self.pool.retain([entry.page])
            self._key_pins.record(key, entry.page)
            return True

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            page = self._key_pins.take(key)
            if page is None:  # nothing pinned under this key: never a second release
                return
            self.pool.release([page])
            entry = self._index.get(key)
            if entry is not None and entry.page == page and not self.pool.is_shared(page):
                self.policy.restore(key)  # its last holder gone: back in the order now

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self.policy.remove(key)
            self.pool.release([entry.page])
            self.report_removed((key,))
            return True

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        policy = self.policy
        return policy.evicted_by_quota(keys) if isinstance(policy, TenantPolicy) else {}

    def tenant_report(self) -> dict[str, dict[str, int | None]]:
        with self._lock:
            if isinstance(self.policy, TenantPolicy):
                return self.policy.report()
            return {}

    def usage(self) -> TierUsage:
        with self._lock:
            entries = len(self._index)
        return TierUsage(
            entries * self.pool.page_bytes, self.pool.num_pages * self.pool.page_bytes, entries
        )

    def clear(self, *, force: bool = False) -> int:
        """Drop unpinned entries (all entries with ``force``; pinned pages stay alive until
        their leases end, because the leases hold their own references)."""
        with self._lock:
            victims = [
                k for k, e in self._index.items() if force or not self.pool.is_shared(e.page)
            ]
            pages = [self._index.pop(k).page for k in victims]
            if force:
                self.policy.clear()
            else:
                for key in victims:
                    self.policy.remove(key)
            self.pool.release(pages)
            self.report_removed(victims)
        return len(pages)

    def __len__(self) -> int:
        return len(self._index)
