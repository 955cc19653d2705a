"""Waiting on a condition instead of sleeping for it: a test that sleeps passes or fails with
the machine's speed; one that waits says, on failure, what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; raise naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
