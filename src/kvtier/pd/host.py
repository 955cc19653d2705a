"""The decoder's engine as its PD receiver sees it: a :class:`~kvtier.pd.receiver.ReceiverHost`
made of the engine's parts (``Engine.receiver_host()`` builds one).

What the receiver needs from an engine, and nothing more::

    pd_buffer                 the PD receive tier among the engine's lower tiers, or None
    attach_hold(rid, hold)    a reservation joins request ``rid``'s lease (released, once, by
                              end_request; refused and released at once if rid has ended)
    expire_unclaimed(ttl)     end requests only the receiver opened that no lookup claimed

Each call runs under the engine's call guard, like the engine's own public calls: counted in
flight, so ``Engine.close`` waits for it, and refused with StateError once close has begun.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from kvtier.config import Config
from kvtier.errors import StateError
from kvtier.fingerprint import Fingerprint
from kvtier.lease import Hold, LeaseTable
from kvtier.lifecycle import CallGuard
from kvtier.pd.buffer import PDBuffer
from kvtier.storage.base import Tier
from kvtier.validation import check_request_id


class EngineReceiverHost:
    """See the module docstring."""

    def __init__(
        self,
        config: Config,
        fingerprint: Fingerprint,
        tiers: Sequence[Tier],
        leases: LeaseTable[Any],
        guard: CallGuard,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self._buffer = next((t for t in tiers if isinstance(t, PDBuffer)), None)
        self._leases = leases
        self._guard = guard

    @property
    def pd_buffer(self) -> PDBuffer | None:
        """The decoder's PD receive buffer (``enable_pd`` with ``pd_role: receiver``), or None."""
        return self._buffer

    def attach_hold(self, request_id: str, hold: Hold) -> None:
        """Put ``hold`` (a PD reservation) into ``request_id``'s lease: released, once, by
        ``end_request``. Raises StateError, with the hold already released, if the request
        ended before (or while) the hold arrived: a late transfer never opens a lease that
        nobody would end."""
        with self._guard.call():
            check_request_id(request_id)
            try:
                lease = self._leases.join(request_id)
            except StateError:
                hold.release()
                raise
            lease.take_hold(hold)

    def expire_unclaimed(self, ttl: float, busy: Collection[str] = ()) -> list[str]:
        """End the requests that only the receiver opened (:meth:`attach_hold`) and that no
        lookup claimed within ``ttl`` seconds: cancelled upstream, routed to another decoder,
        or never real. Their reservations go back to the buffer, once; a later
        ``end_request`` for them is a no-op. ``busy``: requests whose transfer is still in
        flight (kept; their TTL starts again). Returns the ids ended."""
        with self._guard.call():
            return self._leases.expire_unclaimed(ttl, busy=busy)
