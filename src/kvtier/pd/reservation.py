"""The pages one decoder request holds in the PD receive buffer: a lease :class:`Hold`.

:meth:`PDBuffer.reserve <kvtier.pd.buffer.PDBuffer.reserve>` makes one per request and takes
one page reference for each chunk the request needs (received, or already held); the
reservation owns those references and gives them all back exactly once, from the request's
lease (``end_request``) or early on abort, sender death or timeout, whichever comes first.
What giving back means (dropping never-filled index entries, freeing pages, waking waiting
requests) is the buffer's: the reservation only calls :meth:`ReservationOwner.end_reservation`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from kvtier.keys import ChunkKey
from kvtier.lease import LeaseTable


class ReservationOwner(Protocol):
    """The receive buffer as a reservation sees it (:class:`kvtier.pd.buffer.PDBuffer`)."""

    @property
    def page_bytes(self) -> int: ...

    def end_reservation(self, reservation: Reservation) -> None:
        """Give back ``reservation``'s page references; called once, by its release."""
        ...

    def received_count(self, reservation: Reservation) -> int: ...


class Reservation:
    """The pages one request holds in the receive buffer (a lease Hold; released once)."""

    def __init__(
        self,
        tier: ReservationOwner,
        request_id: str,
        pages: list[int],
        new: dict[int, ChunkKey],
        tenant: str = "",
    ) -> None:
        self.tier = tier
        self.request_id = request_id
        self.tenant = tenant  # whose share of the buffer the pages count against ("" no salt)
        self.pages = pages  # one reference each, owned by this reservation
        self.new = new  # page -> key for the chunks this request's sender must fill
        self._released = False
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the receive buffer this reservation holds now (0 once released)."""
        return 0 if self._released else len(self.pages) * self.tier.page_bytes

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.tier.end_reservation(self)

    @property
    def released(self) -> bool:
        return self._released

    def describe(self) -> str:
        if self._released:
            return f"pd reservation of {len(self.pages)} pages (released)"
        received = self.tier.received_count(self)
        text = f"pd reservation of {len(self.pages)} pages ({received} of {len(self.new)} received"
        held = len(self.pages) - len(self.new)
        return text + (f", {held} already held)" if held else ")")


def live_reservations(leases: LeaseTable[Any], owner: ReservationOwner) -> list[Reservation]:
    """The reservations of ``owner`` that requests' leases hold and have not released."""
    return [
        hold
        for lease in leases.live()
        for hold in list(lease.holds)
        if isinstance(hold, Reservation) and hold.tier is owner and not hold.released
    ]
