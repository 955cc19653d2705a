"""How each PD transfer ended, kept for the decoder until it asks.

The receiver's connection threads record an outcome when a request's transfer ends (done,
refused, aborted, broken); the decoder takes it with :meth:`TransferOutcomes.wait` (once).
The book also knows which requests are mid-transfer (:meth:`TransferOutcomes.begin` until
their outcome is recorded), so the reservation sweep never expires a request whose chunks are
still arriving.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

# Outcomes wait until the decoder asks; one it never asks for (the request went away) must not
# stay forever, so only the newest this many are kept.
MAX_UNCOLLECTED_OUTCOMES = 10_000


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How one request's transfer ended, as the decoder learns it."""

    ok: bool
    reason: str = ""
    chunks: int = 0  # chunks received and published
    held: int = 0  # chunks the decoder already had
    nbytes: int = 0


class TransferOutcomes:
    """Outcomes by request id, the newest :data:`MAX_UNCOLLECTED_OUTCOMES` of them, and the
    requests in flight. Thread-safe; :meth:`close` wakes every waiter."""

    def __init__(self) -> None:
        self._outcomes: OrderedDict[str, TransferOutcome] = OrderedDict()
        self._busy: set[str] = set()  # requests whose transfer is in flight: never expired
        self._cond = threading.Condition()
        self._closed = False

    def begin(self, request_id: str) -> None:
        """``request_id``'s transfer has started: in flight until its outcome is recorded."""
        with self._cond:
            self._busy.add(request_id)

    def in_flight(self) -> set[str]:
        """The requests whose transfer has begun and not ended (a copy)."""
        with self._cond:
            return set(self._busy)

    def record(self, request_id: str, outcome: TransferOutcome) -> None:
        with self._cond:
            self._busy.discard(request_id)
            self._outcomes[request_id] = outcome
            self._outcomes.move_to_end(request_id)
            while len(self._outcomes) > MAX_UNCOLLECTED_OUTCOMES:
                self._outcomes.popitem(last=False)
            self._cond.notify_all()

    def wait(self, request_id: str, timeout: float) -> TransferOutcome | None:
        """The outcome of ``request_id``'s transfer (taken: asked once), or None on timeout
        or once closed."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._outcomes or self._closed, timeout
            ):
                return None
            return self._outcomes.pop(request_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
