"""Warnings that repeat are logged once per interval, with a count, not once per event.

A disk that is full fails every chunk written to it; a worker that is down fails every
lookup. One line per event drowns the log (hundreds of lines per run) without saying more
than the first. :class:`RepeatedLog` logs the first occurrence of each key at once, counts
the ones that follow, and logs the next one after ``interval`` seconds with how many were
held back::

    disk tier full: dropped chunk 3f2a... (and 312 more like it in the last 30 s)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable


class RepeatedLog:
    """Rate-limited warnings for ``logger``, one allowance per key. Thread-safe."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: Hashable, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``key`` was logged in the last ``interval``;
        True when this call logged."""
        return self.log(logging.WARNING, key, message, *args)

    def log(self, level: int, key: Hashable, message: str, *args: object) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            self._last[key] = now
        if held:
            message += " (and %d more like it in the last %g s)"
            args = (*args, held, self.interval)
        self.logger.log(level, message, *args)
        return True

    def held(self, key: Hashable) -> int:
        """Occurrences of ``key`` counted but not logged yet."""
        with self._lock:
            return self._held.get(key, 0)
