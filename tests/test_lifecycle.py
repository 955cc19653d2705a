"""CallGuard: calls refused unless open, counted while running, waited for by close."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import StateError, TierError
from kvtier.lifecycle import CallGuard, Lifecycle


def test_calls_are_refused_before_open_and_after_close() -> None:
    guard = CallGuard("thing")
    with pytest.raises(StateError, match="call open"), guard.call():
        pass
    guard.open()
    with guard.call():
        assert guard.running == 1
    assert guard.close(0.1) and guard.state is Lifecycle.CLOSED
    with pytest.raises(StateError, match="closed"), guard.call():
        pass
    with pytest.raises(StateError, match="open it once"):
        guard.open()


def test_close_waits_for_a_running_call_but_only_as_long_as_told() -> None:
    guard = CallGuard("thing")
    guard.open()
    inside, release = threading.Event(), threading.Event()
    seen: list[BaseException] = []

    def call() -> None:
        try:
            with guard.call():
                inside.set()
                release.wait(10)
                raise AssertionError("pool used after close")  # what a torn state raises
        except BaseException as exc:
            seen.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert inside.wait(5)
    start = time.monotonic()
    assert guard.close(0.2) is False  # still running: close gives up after the bound
    assert 0.15 < time.monotonic() - start < 2
    release.set()
    thread.join(5)
    assert isinstance(seen[0], StateError) and "closed during this call" in str(seen[0])


def test_a_kvtier_error_raised_after_close_is_kept() -> None:
    guard = CallGuard("thing")
    guard.open()
    with pytest.raises(TierError), guard.call():
        guard.close(0.0)
        raise TierError("the tier said why")
