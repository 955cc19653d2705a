"""A remote tier's outage window: when the tier stops asking a store that did not answer.

A store either knows itself away (a link that reconnects in the background: its
``available()`` is False until it is back, and it logs and counts its own outages) or it
does not (an object store reached by plain requests). For the second kind, a call that
raises :class:`~kvtier.errors.TierUnavailable` opens a window of the store's
``retry_after_s``: while it is open the tier sends nothing, so reads miss and puts drop at
once instead of each waiting ``blocking_timeout_secs``; the first call after it tries
again. The window counts one outage and logs one line per opening, not per call::

    call raises TierUnavailable --> window open for retry_after_s (outages += 1, one line)
    call within the window      --> refused here: no request
    call after the window       --> sent; if it fails again, the window opens again

Any other failure (a refused command, a bad credential) is no outage: logged once per
30 s per kind, with a count (:class:`~kvtier.repeated_log.RepeatedLog`).
"""

from __future__ import annotations

import threading
import time

from kvtier.errors import TierUnavailable
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.remote.store import ObjectStore


class OutageWindow:
    """See the module docstring. Thread-safe."""

    def __init__(self, store: ObjectStore, repeated: RepeatedLog) -> None:
        self.store = store
        self._repeated = repeated
        self._lock = threading.Lock()
        self._until = 0.0

    def is_down(self) -> bool:
        """Whether the store is away: it says so, or the window is open."""
        return not self.store.available() or time.monotonic() < self._until

    def failed(self, what: str, exc: BaseException) -> None:
        """A call (``what``: lookup, read, write, usage, list) failed with ``exc``."""
        store = self.store
        if not isinstance(exc, TierUnavailable):
            kind = (what, type(exc).__name__)
            self._repeated.warning(
                kind, "%s %s at %s failed: %s", store.name, what, store.where, exc
            )
        elif store.retry_after_s > 0:  # else: the store's link logged and counted it
            with self._lock:
                if time.monotonic() >= self._until:
                    store.counters.outages += 1
                    store.log.warning(
                        "%s tier %s: the store is not answering (%s); misses for now",
                        store.name,
                        store.where,
                        exc,
                    )
                self._until = time.monotonic() + store.retry_after_s
