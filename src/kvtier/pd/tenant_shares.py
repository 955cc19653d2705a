"""Per-tenant shares of the PD receive buffer, from the same ``tenant_quotas`` rows as every tier.

A decoder's receive buffer is bounded: without shares, one tenant whose transfers keep
arriving (and whose requests the decoder has not ended yet) holds every page, and every
other tenant's transfer waits ``pd_allocation_timeout_sec`` and then fails. With
``tenant_quotas`` set, each tenant (a request's ``cache_salt``, "" for none; the sender puts
it in the transfer's ``AllocRequest``) may hold at most its limit of the buffer::

    limit pages = limit.bytes_of(num_pages * page_bytes) // page_bytes   (whole pages, down)

A share is a row's: the salts the table does not name share the ``"*"`` row, one share of
the buffer for all of them together (what their reservations hold is summed against it), so
a client that sends a new ``cache_salt`` with every request gets the row once, not once per
salt. A tenant with a row of its own has its share to itself.

What counts against a tenant is what its live reservations hold: one page reference per key
of the request, received or already held (a held chunk is still a page this request keeps
alive). A reservation is charged when it is made and credited once, when it is released
(request end, abort, sender death, timeout or TTL expiry: :meth:`Reservation.release`), so
the charge of every tenant returns to zero when its requests end. A decoder's lookup pins are
not charged: they pin pages a reservation of the same request already holds, and end with it.

A reservation that would take its tenant over its limit waits, as one that finds the buffer
full does (backpressure: woken by every release and by a changed limit), and fails with
:class:`~kvtier.errors.TransferTimeout` at the deadline; one that needs more pages than the
limit itself is refused at once (:class:`ShareTooSmall`). Other tenants' reservations are not
held back by it. A limit lowered at run time takes nothing away from reservations already
made; it holds back the next ones.

Not thread-safe on its own: the buffer calls it under its lock, which it hands over at
:meth:`TenantShares.attach` for :meth:`TenantShares.rows` (the buffer's ``Tier.tenants``:
readers call it from any thread). It answers the report side of the ledger protocol
(:mod:`kvtier.storage.tenants.ledger`) and never evicts, so nothing is evicted by quota.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from kvtier.config.tenant_quotas import DEFAULT_TENANT, MAX_TENANTS
from kvtier.errors import TransferError
from kvtier.keys import ChunkKey
from kvtier.pd.reservation import Reservation
from kvtier.storage.tenants import TenantQuotas, TenantRow


class ShareTooSmall(TransferError):
    """A request needs more pages than its tenant's whole share of the receive buffer."""


@dataclass(slots=True)
class TenantUse:
    pages: int = 0  # page references the tenant's live reservations hold
    reservations: int = 0  # its live reservations
    waits: int = 0  # reservations that waited because the tenant was at its share
    refusals: int = 0  # ... refused for it (share too small, or still full at the deadline)


class TenantShares:
    """What each tenant's reservations hold in one receive buffer, against its share."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.quotas: TenantQuotas | None = None  # none: no shares, as without tenant_quotas
        self._use: dict[str, TenantUse] = {}
        self._live: set[str] = set()  # tenants whose reservations hold pages (a row's sum)
        self._wake: Callable[[], None] | None = None
        self._lock: AbstractContextManager[object] = nullcontext()

    def attach(
        self, quotas: TenantQuotas, wake: Callable[[], None], lock: AbstractContextManager[object]
    ) -> None:
        """Take shares from ``quotas``; ``wake`` runs on every change of its rows (a raised
        limit may let a waiting reservation through); ``lock`` is the buffer's."""
        self.quotas, self._wake, self._lock = quotas, wake, lock
        quotas.subscribe(wake)

    def detach(self) -> None:
        if self.quotas is not None and self._wake is not None:
            self.quotas.unsubscribe(self._wake)
            self._wake = None

    # -- limits ----------------------------------------------------------------------------
    def limit_pages(self, tenant: str) -> int | None:
        """``tenant``'s share in whole pages (rounded down), None when it has no limit."""
        if self.quotas is None:
            return None
        limit = self.quotas.limit(tenant)
        if limit is None:
            return None
        return limit.bytes_of(self.num_pages * self.page_bytes) // self.page_bytes

    def check(self, request_id: str, tenant: str, need: int) -> None:
        """Raise :class:`ShareTooSmall` (counted) when ``need`` pages exceed ``tenant``'s
        whole share: such a request could never be reserved, so it is not made to wait."""
        limit = self.limit_pages(tenant)
        if limit is not None and need > limit:
            self._row(tenant).refusals += 1
            raise ShareTooSmall(
                f"request {request_id!r} of tenant {tenant!r} needs {need} pages of the PD "
                f"buffer; the tenant's share (tenant_quotas: {self._spec(tenant)}) is {limit} "
                f"of {self.num_pages} pages (raise its limit or pd_buffer_size)"
            )

    def fits(self, tenant: str, need: int) -> bool:
        """Whether ``tenant`` may take ``need`` more pages now (its row's pages, under "*"
        those of every unnamed salt, plus ``need`` within the row's share)."""
        limit = self.limit_pages(tenant)
        return limit is None or self.row_held(tenant) + need <= limit

    def admit(self, request_id: str, tenant: str, need: int, waited: bool) -> bool:
        """:meth:`check`, then :meth:`fits`; a reservation held back by its share for the
        first time (not ``waited``) is counted as a wait."""
        self.check(request_id, tenant, need)
        if self.fits(tenant, need):
            return True
        if not waited:
            self._row(tenant).waits += 1
        return False

    def full_message(self, request_id: str, tenant: str, need: int, timeout: float) -> str:
        """Why a reservation that waited for its tenant's share timed out (counted)."""
        self._row(tenant).refusals += 1
        assert self.quotas is not None
        held = f"holds {self.held(tenant)} of its"
        if self.quotas.row_of(tenant) == DEFAULT_TENANT:
            held = f"holds {self.held(tenant)} (the salts under '*' together hold "
            held += f"{self.row_held(tenant)}) of their"
        return (
            f"request {request_id!r}: tenant {tenant!r} {held} {self.limit_pages(tenant)} "
            f"pages of the PD buffer (tenant_quotas: {self._spec(tenant)}) and needs {need} "
            f"more; none came free within {timeout:g}s"
        )

    def _spec(self, tenant: str) -> str:
        assert self.quotas is not None
        return f"{self.quotas.row_of(tenant)!r}: {self.quotas.limit(tenant)}"

    # -- accounting ------------------------------------------------------------------------
    def held(self, tenant: str) -> int:
        use = self._use.get(tenant)
        return use.pages if use is not None else 0

    def row_held(self, tenant: str) -> int:
        """Pages held under ``tenant``'s row: its own, or under ``"*"`` every unnamed salt's
        (one pass over the tenants holding pages, no more of them than live reservations)."""
        row = None if self.quotas is None else self.quotas.row_of(tenant)
        if row != DEFAULT_TENANT:
            return self.held(tenant)
        assert self.quotas is not None
        row_of, use = self.quotas.row_of, self._use
        return sum(use[t].pages for t in self._live if row_of(t) == DEFAULT_TENANT)

    def take(self, tenant: str, pages: int) -> None:
        """A reservation of ``pages`` references was made for ``tenant``."""
        use = self._row(tenant)
        use.pages += pages
        use.reservations += 1
        if use.pages:
            self._live.add(tenant)

    def give_back(self, tenant: str, pages: int) -> None:
        """That reservation was released (once). Refuses to go below zero instead of
        clamping: a second credit would let the tenant past its share unseen."""
        use = self._use.get(tenant)
        if use is None or use.pages < pages or use.reservations < 1:
            raise AssertionError(
                f"tenant {tenant!r}: {pages} pages given back, "
                f"{use.pages if use else 0} held by its reservations"
            )
        use.pages -= pages
        use.reservations -= 1
        if not use.pages:
            self._live.discard(tenant)

    def clear(self) -> None:
        """The buffer closed: every reservation is gone with its pages."""
        self._use.clear()
        self._live.clear()

    def _row(self, tenant: str) -> TenantUse:
        use = self._use.get(tenant)
        if use is None:
            if len(self._use) >= MAX_TENANTS:  # tenants come from peers: keep the table bounded
                for name in [t for t, u in self._use.items() if u.pages == 0]:
                    del self._use[name]
            use = self._use[tenant] = TenantUse()
        return use

    # -- inspection ------------------------------------------------------------------------
    def rows(self) -> list[TenantRow]:
        """Per tenant seen (and every tenant the table names): what its reservations hold and
        its share. Empty without quotas. ``hits`` is None: a load does not know its tenant."""
        with self._lock:
            return self._rows()

    def _rows(self) -> list[TenantRow]:
        if self.quotas is None:
            return []
        named = [t for t in self.quotas.rows() if t != DEFAULT_TENANT]
        rows = []
        for tenant in sorted(set(self._use) | set(named)):
            use = self._use.get(tenant) or TenantUse()
            limit = self.limit_pages(tenant)
            rows.append(
                TenantRow(
                    tenant,
                    held_bytes=use.pages * self.page_bytes,
                    limit_bytes=None if limit is None else limit * self.page_bytes,
                    chunks=use.pages,
                    reservations=use.reservations,
                    share_waits=use.waits,
                    share_refusals=use.refusals,
                )
            )
        return rows

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        """None: a tenant at its share waits, it never evicts."""
        return {}

    def check_against(self, live: Sequence[Reservation]) -> list[str]:
        """Problems as sentences: per tenant, the pages charged vs those its ``live``
        reservations hold, as their owners (the requests' leases) see them."""
        expected: dict[str, int] = {}
        for reservation in live:
            expected[reservation.tenant] = expected.get(reservation.tenant, 0) + len(
                reservation.pages
            )
        problems = []
        for tenant in sorted(set(self._use) | set(expected)):
            charged, want = self.held(tenant), expected.get(tenant, 0)
            if charged != want:
                problems.append(f"tenant {tenant!r}: {charged} pages charged, {want} reserved")
        return problems
