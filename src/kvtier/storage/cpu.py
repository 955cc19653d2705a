"""The CPU tier: an index of chunk keys to pages of the block pool, evicted by a policy.

Each cached entry owns one reference to its page; a request that hits it takes its own (held
by its lease), so an entry can leave the index while a request still reads its page. Which
entries go, and which chunks are kept at all, is the eviction policy's choice
(``cache_policy``); the tier tells it which are evictable: those whose page nobody else holds
(no pin, no lower-tier write). Reference counts never reach the policy.

An entry the policy finds held leaves its order until it is evictable again
(``kvtier.storage.policy.base``: "Held keys"), so pinned entries cost an eviction nothing.
The tier cannot say when that is for most references: a lease and a lower-tier write give
theirs back to the pool directly, and the pool stays the one owner of the counts. So the
policy looks at a few held entries again at each eviction; only a pin by key (``pin`` /
``unpin``), which goes through the tier, brings its entry back at once.

Where an entry's bytes live is the tier's one seam (:mod:`kvtier.storage.cpu_entries`): a
page of the pool by default, or a codec's stored bytes (:mod:`kvtier.storage.cpu_coded`);
the index, the policy, tenants, pins and eviction here serve both.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvtier.errors import CorruptRecord
from kvtier.keys import ChunkKey
from kvtier.memory import host_copy
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import PutJob, PutOutcome, Tier, TierUsage
from kvtier.storage.cpu_entries import PAGE_OF, CpuEntry, Entries, PageEntries
from kvtier.storage.key_pins import KeyPins
from kvtier.storage.policy import LruPolicy
from kvtier.storage.policy.base import PolicySeam
from kvtier.storage.tenants.ledger import NO_SALT
from kvtier.storage.tenants.local import TenantPolicy

log = logging.getLogger(__name__)


class CpuTier(Tier):
    name = "cpu"
    medium = "CPU"

    def __init__(
        self,
        pool: BlockPool,
        token_bytes: int | Callable[[int], int],
        policy: PolicySeam | None = None,
        entries: Entries | None = None,
        *,
        tenants: TenantPolicy | None = None,
    ) -> None:
        """``token_bytes``: bytes per token, or a chunk's payload bytes by its token count
        (``KVLayout.payload_bytes``, when a KV-cache group stores fewer tokens).
        ``policy``: the eviction policy (a fresh one per tier; default plain LRU).
        ``entries``: where entries keep their bytes (default: pages of ``pool``).
        ``tenants``: with ``tenant_quotas``, the tier's ledger, which is its policy too (a
        composite over one eviction policy per row); ``policy`` is then not given."""
        super().__init__()
        self.pool = pool
        if callable(token_bytes):
            self._payload = token_bytes
        else:
            per_token = token_bytes
            self._payload = lambda n: n * per_token
        self.entries_store: Entries = (
            entries if entries is not None else PageEntries(pool, self._payload)
        )
        self._index: dict[ChunkKey, Any] = {}
        if tenants is not None and policy is not None:
            raise ValueError("a CPU tier with tenants orders its chunks by its ledger")
        # Not `tenants or policy`: an empty policy is falsy (it has a length).
        self.policy: PolicySeam = (
            tenants if tenants is not None else policy if policy is not None else LruPolicy()
        )
        self.tenants: TenantPolicy | None = tenants
        self._lock = threading.RLock()
        # Key-level pins (the Tier interface); each holds one reference to its entry's
        # pin_ref. The engine's own requests pin through pin_keys and their leases instead.
        self._key_pins = KeyPins()
        # Eviction and membership listeners (Tier) are called under the lock.
        if tenants is not None:  # tenant_quotas: a changed row applies now
            tenants.bind(self._evictable, self._lock)
            tenants.quotas.subscribe(self.apply_quotas)

    @property
    def resident(self) -> bool:
        """False through a codec: the pages are staging only, loaded like a lower tier's."""
        return self.entries_store.resident

    # -- page-level API used by the storage manager ----------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages with one reference each for the caller (None: no room). Where
        entries are pages, the policy's victims go when the pool is short."""
        with self._lock:
            pages = self.pool.allocate(count)
            if pages is None and self.resident:
                self._evict(count - self.pool.free_pages)
                pages = self.pool.allocate(count)
            return pages

    def insert(self, key: ChunkKey, page: int, num_tokens: int, tenant: str | None = None) -> bool:
        """Cache ``page`` under ``key``, taking over the caller's reference to it.

        Returns False (and takes nothing) when ``key`` is already cached, the policy declines
        it (``EvictionPolicy.admit``) or there is no room for it: the caller keeps its
        reference and must release it. First writer wins; a duplicate never takes a
        reference nobody would give back. ``tenant``: the storing request's ``cache_salt``;
        with ``tenant_quotas`` a tenant over its limit then drops its own victims (maybe this
        chunk: it stays inserted, its reference taken over, and is evicted as any other).
        """
        tenants, tenant = self.tenants, tenant or NO_SALT
        with self._lock:
            if key in self._index:
                self.policy.touch([key])
                return False
            if tenants is not None:
                admitted = tenants.admit_as(key, num_tokens, tenant)
            else:
                admitted = self.policy.admit(key, num_tokens)
            if not admitted:
                self.counters.dropped += 1
                return False
        store = self.entries_store
        prepared = store.prepare(page, num_tokens)  # a codec encodes outside the lock
        with self._lock:
            if key in self._index:  # another store of the same chunk got here first
                return False
            entry = store.admit(page, num_tokens, prepared, self._evict)
            if entry is None:
                self.counters.dropped += 1
                return False
            self._index[key] = entry
            victims: list[ChunkKey] = []
            if tenants is not None:  # into the tenant's order; over its limit: its victims
                victims = tenants.charge(key, tenant)
            else:
                self.policy.insert(key)
            self.counters.stored += 1
            self.counters.bytes_written += store.stored_bytes(entry)
            self.report_added((key,))
            self._drop(victims)
        store.settle(page)
        return True

    def enforce_quota(self, tenant: str | None) -> None:
        """Bring ``tenant`` back within its limit now (after a store has let go of its new
        chunks' pages, which no eviction could take while it held them). Without quotas,
        or within its limit, nothing."""
        tenants, tenant = self.tenants, tenant or NO_SALT
        if tenants is not None and tenants.over_quota(tenant):
            with self._lock:
                self._drop(tenants.enforce(tenant))

    def apply_quotas(self) -> None:
        """The quota table changed: tenants move between orders, and each one now over its
        limit drops its own victims."""
        if self.tenants is not None:
            with self._lock:
                self._drop(self.tenants.regroup())

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, CpuEntry]:
        """The cached entries among ``keys``, each with one new page reference for the caller
        (its lease to hold), marked used; atomic with respect to eviction. Nothing where
        entries are not pages (the manager pins those by key)."""
        found: dict[ChunkKey, CpuEntry] = {}
        if not self.resident:
            return found
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
        a long cached prompt pins hundreds of chunks. Nothing where entries are not pages."""
        if not self.resident:
            return []
        with self._lock:
            index = self._index
            found = list(map(index.get, keys))
            if not all(found):  # entries are always true: all() stops at the first miss
                found = found[: found.index(None)]
            if not found:
                return []
            self.policy.touch(keys[: len(found)])
            pages: list[int] = list(map(PAGE_OF, found))
            self.pool.retain(pages)
        return pages

    def make_room(self, chunks: int) -> None:
        """Where entries are not pages, evict now what ``chunks`` chunks need (at the mean
        references of an entry), so a store's own chunks do not push each other out."""
        if self.resident:
            return
        with self._lock:
            store, index = self.entries_store, self._index
            held = store.holder.used_pages
            per_chunk = held / len(index) if index else 1
            self._evict(math.ceil(chunks * per_chunk) - store.holder.free_pages)

    def entries(self, keys: Sequence[ChunkKey]) -> list[Any]:
        with self._lock:
            return [self._index.get(k) for k in keys]

    def _evict(self, needed: int) -> int:
        """Evict the policy's victims until ``needed`` references are freed; how many were."""
        freed = 0
        refs = self.entries_store.refs
        while freed < needed:
            # An entry of one reference each (pages, a fixed-size codec) takes the victims
            # at once; entries of several (a byte codec) one at a time.
            step = needed - freed if self.resident else 1
            victims = self.policy.evict(step, self._evictable)
            if not victims:
                break
            freed += sum(len(refs(self._index[key])) for key in victims)
            self._drop(victims)
        return freed

    def _evictable(self, key: ChunkKey) -> bool:
        store = self.entries_store
        return not store.holder.is_shared(store.pin_ref(self._index[key]))

    def _drop(self, victims: list[ChunkKey]) -> int:
        """Drop the policy's ``victims`` (forgotten there already) and free what they hold."""
        if not victims:
            return 0
        self._release([self._index.pop(key) for key in victims])
        self.counters.evicted += len(victims)
        self.report_evicted(victims)
        return len(victims)

    def _release(self, entries: list[Any]) -> None:
        refs = self.entries_store.refs
        self.entries_store.holder.release([r for entry in entries for r in refs(entry)])

    def owned_pages(self) -> set[int]:  # none where entries are not pages
        if not self.resident:
            return set()
        with self._lock:
            return {e.page for e in self._index.values()}

    # -- the common tier interface -----------------------------------------------------------
    def open(self) -> None:
        return None

    def close(self) -> None:
        if self.tenants is not None:
            self.tenants.quotas.unsubscribe(self.apply_quotas)
        self.clear(force=True)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        """The entry's payload into ``out`` (a page view). One that is not what was stored (a
        codec's checksum) is a miss, and the entry is dropped."""
        store = self.entries_store
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.counters.misses += 1
                return None
            store.holder.retain(store.refs(entry))  # a read holds what it reads
        try:
            store.read_into(entry, out)
        except CorruptRecord as exc:
            self._drop_corrupt(key, entry, str(exc))
            return None
        finally:
            store.holder.release(store.refs(entry))
        self.counters.hits += 1
        self.counters.bytes_read += store.stored_bytes(entry)
        return store.num_tokens(entry)

    @contextlib.contextmanager
    def read_view(self, key: ChunkKey) -> Iterator[tuple[torch.Tensor, int] | None]:
        """The entry's payload where it lies and its token count, for a reader that sends the
        bytes on (a P2P serve) instead of copying them out first; None for a miss or where
        entries are not pages (a codec's: use :meth:`get_into`). A read reference holds the
        page until the block exits: eviction still drops the entry at once, only the page's
        return to the free list waits for the reader (as it does for ``get_into``'s copy)."""
        store = self.entries_store
        if not store.resident:
            yield None
            return
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.counters.misses += 1
            else:
                store.holder.retain(store.refs(entry))
        if entry is None:
            yield None
            return
        try:
            yield store.holder.page_bytes_view(entry.page, entry.nbytes), entry.num_tokens
            self.counters.hits += 1
            self.counters.bytes_read += entry.nbytes
        finally:
            store.holder.release(store.refs(entry))

    def count_served(self, num_tokens: int) -> None:
        """A hit the engine served from a page of this tier's that its lookup pinned."""
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += self._payload(num_tokens)

    def _drop_corrupt(self, key: ChunkKey, entry: Any, reason: str) -> None:
        log.warning("cpu tier: chunk %s is corrupt (%s): dropped, a miss", key.hex(), reason)
        self.note_corrupt(key, reason)
        with self._lock:
            self.counters.corrupt += 1
            self.counters.misses += 1
            if self._index.get(key) is entry:
                del self._index[key]
                self.policy.remove(key)
                self._release([entry])
                self.report_removed((key,))

    def put(self, job: PutJob) -> None:
        key = job.key
        if self.contains([key])[0]:
            job.done(PutOutcome.EXISTS)
            return
        pages = self.allocate(1)
        if pages is None:
            self.counters.dropped += 1
            job.done(PutOutcome.DROPPED, "no free page")
            return
        page = self.pool.page_bytes_view(pages[0], job.payload.numel())
        host_copy.copy_now(page, job.payload)  # on kvtier's copy threads, as a store's chunks
        if not self.insert(key, pages[0], job.num_tokens, job.tenant):
            self.pool.release(pages)
            stored = self.contains([key])[0]
            job.done(PutOutcome.EXISTS if stored else PutOutcome.DROPPED)
            return
        job.done(PutOutcome.STORED)

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            store = self.entries_store
            ref = store.pin_ref(entry)
            store.holder.retain([ref])
            self._key_pins.record(key, ref)
            return True

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        """Pin the leading run of ``keys`` that is cached and mark it used (the policy's
        touch, as a CPU lookup does), under one lock; how many were pinned. A pin is one
        reference to the page eviction looks at (``pin_ref``): a reader retains every
        reference for itself (``get_into``), so nothing more is needed to keep the bytes."""
        with self._lock:
            pinned = 0
            for key in keys:
                if not self.pin(key):
                    break
                pinned += 1
            if pinned:
                self.policy.touch(keys[:pinned])
        return pinned

    def unpin(self, key: ChunkKey) -> None:
        store = self.entries_store
        with self._lock:
            ref = self._key_pins.take(key)
            if ref is None:  # nothing pinned under this key: never a second release
                return
            store.holder.release([ref])
            entry = self._index.get(key)
            if (
                entry is not None
                and store.pin_ref(entry) == ref
                and not store.holder.is_shared(ref)
            ):
                self.policy.restore(key)  # its last holder gone: back in the order now

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self.policy.remove(key)
            self._release([entry])
            self.report_removed((key,))
            return True

    def usage(self) -> TierUsage:
        store = self.entries_store
        with self._lock:
            used = sum(len(store.refs(e)) for e in self._index.values())
            entries = len(self._index)
        size = store.holder.page_bytes
        return TierUsage(used * size, store.holder.num_pages * size, entries)

    def clear(self, *, force: bool = False) -> int:
        """Drop unpinned entries (all entries with ``force``; pinned ones stay alive until
        their pins end, because the pins hold their own references)."""
        with self._lock:
            victims = [k for k in self._index if force or self._evictable(k)]
            dropped = [self._index.pop(k) for k in victims]
            if force:
                self.policy.clear()
            else:
                for key in victims:
                    self.policy.remove(key)
            self._release(dropped)
            self.report_removed(victims)
        return len(victims)

    def __len__(self) -> int:
        return len(self._index)
