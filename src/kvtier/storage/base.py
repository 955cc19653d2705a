"""The interface every storage tier implements, and the types it speaks.

Protocol (who calls what, who owns what):

* The :class:`~kvtier.storage.manager.StorageManager` is the only caller. It opens a tier once
  (``open``) and closes it once (``close``, which drains in-flight writes and is idempotent).
* ``contains(keys)`` answers for a whole batch in one call (one round trip for a remote
  tier). It takes no reference: a later ``get_into`` may still miss.
* ``pin(key)`` keeps an entry from being evicted until ``unpin(key)`` and returns True; it
  returns False when the entry is gone (the manager then ends the hit there). A tier that
  cannot pin against other clients (a shared remote store) returns True without a guarantee,
  and a later ``get_into`` may miss: the manager ends the hit at that chunk and the engine
  recomputes the rest. Pins are counted per key; the manager pairs every pin that returned
  True with exactly one unpin, through a request lease. ``pin_many`` / ``unpin_many`` are the
  same for a run of keys (the manager pins a lower-tier run at once).
* ``get_into(key, out)`` writes the chunk's bytes into ``out`` (a uint8 view of an allocator
  page, so reads land in their final place with no intermediate copy) after checking the
  checksum, and returns the chunk's token count, or None for a miss. A corrupt entry is a
  miss: logged, removed and counted, never returned.
* A tier whose chunks already sit in this process's memory, checked as they are copied out
  (``serves_views = True``: the PD buffer), also takes for ``out`` a view of the caller's KV
  tensor of the chunk's shape (``[2, layers, tokens, hidden]`` in the layout's dtype; rows of
  its last two dimensions contiguous) and copies into it directly: one copy from the tier to
  the caller, no staging page. On a miss that view may hold garbage (the caller uses nothing
  past the end of what was loaded).
* A read that runs past ``blocking_timeout_secs`` (a stuck network filesystem) raises
  :class:`ReadAbandoned`: a miss, but the read is still running and may yet write into its
  ``out``, so the caller keeps each page in ``busy`` out of use until its future is done.
* ``put(job)`` stores a :class:`PutJob` (key, payload, num_tokens, tenant, on_done) and may
  return before the write lands. ``job.payload`` (a uint8 view of an allocator page) stays
  valid and unchanged until ``job.on_done`` runs; ``on_done`` runs exactly once per put, also
  on failure, from any thread, and must not block. A tier that is busy or full may drop the
  write: it reports that outcome. ``job.tenant`` is the storing request's ``cache_salt``
  ("" for none): a tier that keeps tenants (``tenants`` is its ledger) charges it the chunk;
  any other tier ignores it. The tenant rides the put: no call before it names it.
* ``add_evict_listener(fn)``: ``fn(keys)`` is told the keys the tier evicted on its own (to
  make room), from any thread, after the eviction; listeners add up (each added one is
  called, in order) and one that raises is logged, never propagated. A tier that never
  evicts by itself (a remote store that evicts on the server) never calls them.
* ``add_membership_listener(fn)``: ``fn(change, keys)`` is told every change of what the
  tier holds (what KV events publish): ``ADDED`` once a chunk is readable from the tier (an
  insert taken, a write landed: never when it is only queued), ``REMOVED`` for every way one
  leaves (evicted, removed, cleared, found corrupt, its directory lost, expired). Called from
  any thread; an ``ADDED`` is reported under the lock that makes the chunk visible, so a
  removal of the same key is never reported before it. Listeners must not block or call
  back into the tier; one that raises is logged, never propagated. A chunk another process
  deletes (a shared store's own eviction) leaves without a report: the tier cannot see it.
* ``tenants`` is the tier's ledger under ``tenant_quotas`` (:mod:`kvtier.storage.tenants`,
  made from the engine's one quota table when the tier is built), None when it keeps no
  tenants: the one tenant hook. Readers (stats, metrics, explain) ask it for its rows and
  its quota evictions; the tier charges it each put's tenant itself.
* ``counters`` is a typed :class:`TierCounters` (a tier with counts of its own subclasses it);
  ``counters.as_dict()`` is what ``Engine.stats()`` reports for the tier.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import TierUnavailable
from kvtier.keys import ChunkKey
from kvtier.lease import LeaseTable
from kvtier.storage.tenants.ledger import TenantReport

log = logging.getLogger(__name__)

EvictListener = Callable[[Sequence[ChunkKey]], None]


class Membership(enum.Enum):
    """A change of what a tier holds (see ``add_membership_listener``)."""

    ADDED = "added"  # readable from the tier now
    REMOVED = "removed"  # no longer held, whatever the way it left


MembershipListener = Callable[[Membership, Sequence[ChunkKey]], None]


class PutOutcome(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"  # already held: nothing written, nothing taken
    DROPPED = "dropped"  # no room, or too many bytes in flight: counted, not an error
    FAILED = "failed"  # I/O or server error: counted and logged


@dataclass(frozen=True, slots=True)
class PutResult:
    key: ChunkKey
    outcome: PutOutcome
    detail: str = ""


OnDone = Callable[[PutResult], None]


@dataclass(frozen=True, slots=True)
class PutJob:
    """One chunk to store (see ``put`` in the module docstring)."""

    key: ChunkKey
    payload: torch.Tensor  # uint8, the chunk's bytes; unchanged until on_done runs
    num_tokens: int
    tenant: str  # the storing request's cache_salt ("" for none)
    on_done: OnDone  # exactly once, also on failure; from any thread; never blocks

    def done(self, outcome: PutOutcome, detail: str = "") -> None:
        """Complete the job with ``outcome``."""
        self.on_done(PutResult(self.key, outcome, detail))


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    entries: int


class ReadAbandoned(TierUnavailable):
    """Reads that did not finish within the timeout: misses whose ``out`` buffers are still
    being written. ``busy`` maps the position of each such item in the call (0 for
    ``get_into``) to the future that completes when its read stops touching the buffer;
    ``results`` holds what the other items of a ``get_many_into`` returned (None for the
    busy ones)."""

    def __init__(
        self, message: str, busy: dict[int, Future[Any]], results: list[int | None]
    ) -> None:
        super().__init__(message)
        self.busy = busy
        self.results = results


@dataclass
class TierCounters:
    """Per-tier event counts, reported in ``Engine.stats()``. Every tier has these; a tier
    that counts more subclasses this dataclass with fields of its own (``DiskCounters``...),
    so a counter is an attribute a type checker knows, never a string key."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    dropped: int = 0
    failed: int = 0
    evicted: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


CORRUPTIONS_KEPT = 1024  # reasons a tier remembers for explain (oldest forgotten first)


class Tier(ABC):
    """A place chunks can live. See the module docstring for the protocol."""

    name: str = "tier"
    # How KV events name this tier's copies (vLLM's ``medium``: CPU, DISK, REMOTE; see
    # integrations/vllm/events.py for what the router credits); None: never published.
    medium: str | None = None
    counters: TierCounters
    serves_views: bool = False  # get_into also takes a view of the caller's KV (see above)
    # False: stores never write to it (the p2p tier: peers' chunks are read, never put)
    accepts_puts: bool = True
    # tenant_quotas: the tier's ledger (kvtier.storage.tenants), made from the engine's one
    # quota table when the tier is built; None: the tier keeps no tenants. The only tenant
    # hook: readers ask it for rows and quota evictions, the tier charges it on each put.
    tenants: TenantReport | None = None

    def __init__(self) -> None:
        self.counters = TierCounters()
        self._evict_listeners: list[EvictListener] = []
        self._membership_listeners: list[MembershipListener] = []
        # Why recent corrupt entries failed (key -> reason), for explain; bounded.
        self._corruptions: OrderedDict[ChunkKey, str] = OrderedDict()
        self._corruptions_lock = threading.Lock()

    def note_corrupt(self, key: ChunkKey, reason: str) -> None:
        """For the tier itself: ``key`` failed its checks for ``reason`` (e.g. the KV-cache
        group whose bytes differ); :meth:`corruption` answers it for a while."""
        with self._corruptions_lock:
            self._corruptions[key] = reason
            self._corruptions.move_to_end(key)
            while len(self._corruptions) > CORRUPTIONS_KEPT:
                self._corruptions.popitem(last=False)

    def corruption(self, key: ChunkKey) -> str | None:
        """Why ``key`` was last found corrupt in this tier, if it was recently."""
        with self._corruptions_lock:
            return self._corruptions.get(key)

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Tell ``listener`` the keys this tier evicts on its own from now on (see the module
        docstring). Add listeners before the tier is shared between threads (at open)."""
        self._evict_listeners.append(listener)

    def report_evicted(self, keys: Sequence[ChunkKey]) -> None:
        """For the tier itself: tell every listener, after the keys are gone (they are
        removals too: the membership listeners hear of them)."""
        if not keys:
            return
        for listener in self._evict_listeners:
            try:
                listener(keys)
            except Exception:  # a listener's bug must not fail the put that evicted
                log.exception("%s tier: an eviction listener raised", self.name)
        self.report_removed(keys)

    def add_membership_listener(self, listener: MembershipListener) -> None:
        """Tell ``listener`` every chunk this tier adds or loses from now on (see the module
        docstring). Add listeners before the tier is shared between threads (at open)."""
        self._membership_listeners.append(listener)

    def report_added(self, keys: Sequence[ChunkKey]) -> None:
        """For the tier itself: ``keys`` are readable now (call it under the lock that made
        them visible, so that their removal cannot be reported first)."""
        self._report(Membership.ADDED, keys)

    def report_removed(self, keys: Sequence[ChunkKey]) -> None:
        """For the tier itself: ``keys`` are no longer held (any way they left but an
        eviction, which :meth:`report_evicted` reports)."""
        self._report(Membership.REMOVED, keys)

    def _report(self, change: Membership, keys: Sequence[ChunkKey]) -> None:
        if not keys:
            return
        for listener in self._membership_listeners:
            try:
                listener(change, keys)
            except Exception:  # a listener's bug must not fail the call that changed it
                log.exception("%s tier: a membership listener raised", self.name)

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None: ...

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        """Batch form of :meth:`get_into`; tiers override it to overlap or pipeline reads."""
        return [self.get_into(key, out) for key, out in items]

    @abstractmethod
    def put(self, job: PutJob) -> None: ...

    @abstractmethod
    def remove(self, key: ChunkKey) -> bool: ...

    def pin(self, key: ChunkKey) -> bool:
        return False

    def unpin(self, key: ChunkKey) -> None:
        return None

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        """Pin ``keys`` in order, stopping at the first that :meth:`pin` refuses; returns how
        many were pinned (each of those needs one unpin). Tiers override it to take their
        lock once for a long prompt's thousands of chunks."""
        for i, key in enumerate(keys):
            if not self.pin(key):
                return i
        return len(keys)

    def unpin_many(self, keys: Sequence[ChunkKey]) -> None:
        """:meth:`unpin` each of ``keys``."""
        for key in keys:
            self.unpin(key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """A hint: ``keys`` were just used from a tier above (a CPU hit). A tier that keeps
        copies of what is above it refreshes them in its eviction order, so what is hit most
        in memory is not the first to go from disk. Keys it does not hold are ignored."""
        return None

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @abstractmethod
    def clear(self) -> int:
        """Remove every unpinned entry; return how many were removed."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until writes submitted so far have landed. True when nothing is in flight."""
        return True

    def audit(self, leases: LeaseTable[Any]) -> list[str]:
        """Problems with references this tier hands to request leases, as sentences (the
        engine's ``check_invariants``); a tier whose pins leases do not hold has none."""
        return []
