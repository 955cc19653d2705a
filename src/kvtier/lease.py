"""Request leases: everything a request holds, released together, exactly once.

The rule: a reference is given back exactly once, on whatever path its request ends. kvtier
keeps it by construction rather than by care at each call site: a request never touches a
reference count itself. Whatever it holds (pinned CPU pages, pins on lower-tier entries, PD
reservations) is recorded in its :class:`Lease` when taken, and :meth:`Lease.release` gives
each back once. ``Engine.end_request`` releases the lease on every path (finished, aborted,
failed, timed out); a second call finds no lease and does nothing.

What the request's calls found, loaded and stored is kept on its lease too
(:class:`RequestRecord`), so it ends with the request: its log line and the found / loaded /
unused counters are made of it when the lease ends, and no map keyed by request id outlives it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvtier.errors import StateError
from kvtier.keys import RequestKeys
from kvtier.memory.block_pool import BlockPool
from kvtier.memory.device import Landed, LandedSet

PlanT = TypeVar("PlanT")


class Hold(Protocol):
    """Something other than CPU pages that a lease holds (a lower-tier pin, a reservation).

    A hold can be given back before its lease ends (a PD reservation whose transfer failed);
    the lease then reports it no more: ``released`` is true and ``nbytes`` is 0."""

    @property
    def nbytes(self) -> int: ...

    @property
    def released(self) -> bool: ...

    def release(self) -> None: ...

    def describe(self) -> str: ...


@dataclass
class CallbackHold:
    """A hold released by calling ``release_fn`` once."""

    nbytes: int
    description: str
    release_fn: Callable[[], None]
    _done: bool = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self.release_fn()

    @property
    def released(self) -> bool:
        return self._done

    def describe(self) -> str:
        return self.description


@dataclass
class RequestRecord:
    """What happened to one request (its lookups, loads and stores), kept on its lease."""

    prompt_tokens: int = 0
    found: int = 0  # tokens its last lookup found in kvtier's tiers (beyond what it held)
    loaded: int = 0  # tokens loaded into the engine since
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    stored: int = 0  # tokens of its prompt newly stored (when a connector names the request)
    noted: bool = False  # anything above was recorded (a lease of a bare store is not)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def unused(self) -> int:
        """Found and never loaded (the engine had them already, or never asked)."""
        return max(0, self.found - self.loaded)

    def note_found(self, prompt_tokens: int, found: int) -> None:
        with self._lock:
            self.prompt_tokens, self.found, self.noted = prompt_tokens, found, True

    def note_loaded(self, tokens: int, by_tier: Mapping[str, int]) -> None:
        """``tokens`` copied into the engine, ``by_tier`` of them from each tier."""
        with self._lock:
            self.noted = True
            self.loaded += tokens
            for tier, n in by_tier.items():
                if n > 0:
                    self.loaded_by_tier[tier] = self.loaded_by_tier.get(tier, 0) + n

    def note_stored(self, tokens: int, prompt_tokens: int) -> None:
        with self._lock:
            self.noted = True
            self.stored += tokens
            self.prompt_tokens = max(self.prompt_tokens, prompt_tokens)


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A snapshot of one lease for stats, ``leaks()`` and the admin API."""

    request_id: str
    age_s: float
    pinned_pages: int
    pinned_bytes: int
    holds: tuple[str, ...]


@dataclass
class Lease(Generic[PlanT]):
    """All references one request holds. Only the engine's lease table creates these."""

    request_id: str
    pool: BlockPool
    created: float = field(default_factory=time.monotonic)
    pages: list[int] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    released: bool = False
    # The last lookup of this request, reused by retrieve (see StorageManager.locate).
    plan: PlanT | None = None
    # The request's tokens and chunk keys (hashed once, by its lookup; see RequestKeys).
    keys: RequestKeys | None = None
    # Loads of the request running now (Engine.loading); an end that comes meanwhile only
    # sets ``ending``, and the last load to finish releases the lease.
    busy: int = 0
    ending: bool = False
    # Set when a load of this request came up short: the chunks it holds from the first
    # failed one on (a count from chunk 0). A later lookup of the request stops there.
    limit: int | None = None
    # False while only something acting for the request (a PD receiver) opened the lease and
    # the request itself (a lookup) has not come: since ``joined``, such a lease may expire.
    claimed: bool = True
    joined: float = 0.0
    # What the request found, loaded and stored (observability; ends with the lease).
    record: RequestRecord = field(default_factory=RequestRecord)

    # Copies out of this lease's pages into the engine that may still run (a device load):
    # the pages go back only once they landed.
    _copies: LandedSet = field(default_factory=LandedSet, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def copying(self, landed: Landed) -> None:
        """Copies from this lease's pages are in flight until ``landed``: :meth:`release`
        waits for them before it gives the pages back. A lease already released waits now."""
        with self._lock:
            if not self.released:
                self._copies.add(landed)
                return
        landed.wait()

    def take_pages(self, pages: list[int]) -> None:
        """Record pages the caller holds one reference to each (ownership moves here).

        If the request ended meanwhile (another thread called ``end_request``), the pages are
        given back at once and the caller gets a :class:`StateError`: nothing leaks.
        """
        with self._lock:
            if not self.released:
                self.pages.extend(pages)
                return
        self.pool.release(pages)
        raise StateError(f"request {self.request_id!r} ended while it was taking pages")

    def untake_pages(self, pages: list[int]) -> None:
        """Move the references to ``pages`` (which this lease holds) back to the caller, who
        must then release or hand them on. Raises :class:`StateError`, moving nothing, if the
        request ended meanwhile (its pages were given back already)."""
        with self._lock:
            if self.released:
                raise StateError(f"request {self.request_id!r} ended while it was loading")
            for page in pages:
                self.pages.remove(page)

    def take_hold(self, hold: Hold) -> None:
        with self._lock:
            if not self.released:
                self.holds.append(hold)
                return
        hold.release()
        raise StateError(f"request {self.request_id!r} ended while it was taking a hold")

    def release(self) -> None:
        """Give back everything, once. Safe to call again (no-op)."""
        with self._lock:
            if self.released:
                return
            self.released = True
            pages, self.pages = self.pages, []
            holds, self.holds = self.holds, []
            self.plan = None
            self.keys = None
        try:
            self._copies.wait()  # nothing is given back while a copy from it runs
            for hold in holds:
                hold.release()
        finally:
            self.pool.release(pages)

    def info(self) -> LeaseInfo:
        with self._lock:
            return self._info()

    def _info(self) -> LeaseInfo:
        # What is held now: a hold given back early stays in the list (the lease releases it
        # again, a no-op) but is neither counted nor described.
        held = [h for h in self.holds if not h.released]
        return LeaseInfo(
            request_id=self.request_id,
            age_s=time.monotonic() - self.created,
            pinned_pages=len(self.pages),
            pinned_bytes=len(self.pages) * self.pool.page_bytes + sum(h.nbytes for h in held),
            holds=tuple(h.describe() for h in held),
        )


class LeaseTable(Generic[PlanT]):
    """request_id -> Lease, thread-safe.

        It also remembers the last ``ended_memory`` request ids that ended, so that something
        arriving for a request after it ended (a PD transfer that was late, say) is refused
        instead of opening a new lease that nobody would ever end: a reference taken for an ended
    request would never be given back.
    """

    def __init__(self, pool: BlockPool, ended_memory: int = 65536) -> None:
        self._pool = pool
        self._leases: dict[str, Lease[PlanT]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_memory = ended_memory
        self._lock = threading.Lock()

    def open(self, request_id: str) -> Lease[PlanT]:
        """The live lease of ``request_id``, created on first use. The caller is the request
        itself (a lookup), so an id that ended before starts over as a new request; the
        lease is claimed (it no longer expires: the request will end it)."""
        with self._lock:
            self._ended.pop(request_id, None)
            lease = self._open_locked(request_id)
            lease.claimed = True
            return lease

    def join(self, request_id: str) -> Lease[PlanT]:
        """The live lease of ``request_id`` for something acting on the request's behalf
        (a PD receiver attaching a reservation). Raises :class:`StateError` if the request
        already ended: nobody would end a lease opened now. A lease the request itself has
        not opened yet is unclaimed: :meth:`expire_unclaimed` ends it if the request never
        comes (cancelled upstream, sent to another decoder, or never a real request)."""
        with self._lock:
            if request_id in self._ended:
                raise StateError(f"request {request_id!r} already ended")
            lease = self._leases.get(request_id)
            if lease is None:
                lease = self._open_locked(request_id)
                lease.claimed = False
            if not lease.claimed:
                lease.joined = time.monotonic()
            return lease

    def _open_locked(self, request_id: str) -> Lease[PlanT]:
        lease = self._leases.get(request_id)
        if lease is None:
            lease = self._leases[request_id] = Lease[PlanT](request_id, self._pool)
        return lease

    def get(self, request_id: str) -> Lease[PlanT] | None:
        with self._lock:
            return self._leases.get(request_id)

    def end(self, request_id: str) -> bool:
        """Release the request's lease. Returns False when it had none (already ended). While
        a load of the request runs (:meth:`begin_busy`), the release waits for its end."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and lease.busy:
                if lease.ending:
                    return False  # ended already, the release is pending
                lease.ending = True
                return True
            self._leases.pop(request_id, None)
            self._remember_ended(request_id)
        if lease is None:
            return False
        lease.release()
        return True

    def begin_busy(self, request_id: str) -> Lease[PlanT] | None:
        """Mark a load of ``request_id`` running; None (nothing marked) when the request holds
        no lease or is ending: a load for it must not run. Pair with :meth:`end_busy`."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.ending:
                return None
            lease.busy += 1
            return lease

    def end_busy(self, lease: Lease[PlanT]) -> None:
        """The load :meth:`begin_busy` marked is done; an end that came meanwhile happens now."""
        with self._lock:
            lease.busy -= 1
            if lease.busy or not lease.ending:
                return
            if self._leases.get(lease.request_id) is lease:
                del self._leases[lease.request_id]
                self._remember_ended(lease.request_id)
        lease.release()

    def expire_unclaimed(
        self, ttl: float, now: float | None = None, busy: Collection[str] = ()
    ) -> list[str]:
        """End every lease that only a joiner opened, ``ttl`` seconds or more after its last
        join: the request never came to claim what was held for it. Returns their ids.
        ``busy`` requests (a transfer still filling what the lease holds) are kept and their
        clock restarts: the TTL counts from when the joiner was last done with them.

        An expired lease ends like any other (its holds released once; the id remembered,
        so a later join is refused); the request's own ``end`` afterwards finds nothing and
        releases nothing, and a lookup that comes after all starts a new lease."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = []
            for lease in self._leases.values():
                if lease.claimed:
                    continue
                if lease.request_id in busy:
                    lease.joined = now
                elif now - lease.joined >= ttl:
                    stale.append(lease)
            for lease in stale:
                del self._leases[lease.request_id]
                self._remember_ended(lease.request_id)
        for lease in stale:
            lease.release()
        return [lease.request_id for lease in stale]

    def end_all(self) -> int:
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            lease.release()
        return len(leases)

    def _remember_ended(self, request_id: str) -> None:
        self._ended[request_id] = None
        self._ended.move_to_end(request_id)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)

    def live(self) -> list[Lease[PlanT]]:
        """The leases open now (a copy of the list; the leases themselves are live)."""
        with self._lock:
            return list(self._leases.values())

    def snapshot(self) -> list[LeaseInfo]:
        with self._lock:
            leases = list(self._leases.values())
        return [lease.info() for lease in leases]

    def __len__(self) -> int:
        return len(self._leases)
