"""The lifecycle every long-lived kvtier object follows: constructed (nothing started),
open (threads, connections and memory live), closed (everything released; use raises)."""

from __future__ import annotations

import enum
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, Protocol, Self, TypeVar

from kvtier.errors import KVTierError, StateError


class Lifecycle(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class Opens(ABC):
    """An object with :meth:`open` and an idempotent :meth:`close`: ``with obj:`` opens it
    and closes it on every way out of the block."""

    @abstractmethod
    def open(self) -> Self: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


class CallGuard:
    """Calls in flight on an object that can be closed under them.

    ``with guard.call():`` around each public call: refused with :class:`StateError` unless
    open, counted while it runs; a foreign error it raises once close has begun becomes a
    StateError.
    ``close(timeout)`` refuses new calls at once, then waits up to ``timeout`` for the
    running ones, so what they use (a file descriptor, a thread pool, a connection) is freed
    only after them, and a call stuck in the kernel cannot hold close forever (close returns
    False then, and the caller keeps what the stuck call may touch)::

        NEW --open()--> OPEN --close()--> CLOSED      (close of NEW or CLOSED: CLOSED at once)
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.state = Lifecycle.NEW
        self._running = 0
        self._cond = threading.Condition()

    def open(self) -> None:
        with self._cond:
            if self.state is not Lifecycle.NEW:
                raise StateError(f"{self.what} is {self.state.value}; open it once")
            self.state = Lifecycle.OPEN

    @contextmanager
    def call(self) -> Iterator[None]:
        with self._cond:
            if self.state is not Lifecycle.OPEN:
                hint = "call open() first" if self.state is Lifecycle.NEW else "it was closed"
                raise StateError(f"{self.what} is {self.state.value}: {hint}")
            self._running += 1
        try:
            yield
        except Exception as exc:
            if self.state is Lifecycle.OPEN or isinstance(exc, KVTierError):
                raise  # a kvtier error says what happened (ReadAbandoned must reach its caller)
            # close() began meanwhile and freed what the call was using: the caller sees
            # "closed", never the torn state (an AssertionError, a shut-down pool).
            raise StateError(f"{self.what} was closed during this call ({exc})") from exc
        finally:
            with self._cond:
                self._running -= 1
                if self._running == 0:
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new calls; wait up to ``timeout`` for running ones. True when none is left
        running (also when it was never open or is already closed)."""
        with self._cond:
            self.state = Lifecycle.CLOSED
            return self._cond.wait_for(lambda: self._running == 0, timeout)

    @property
    def running(self) -> int:
        with self._cond:
            return self._running


class Guarded(Protocol):
    """An object whose public calls a :class:`CallGuard` counts."""

    _guard: CallGuard


G = TypeVar("G", bound=Guarded)
P = ParamSpec("P")
R = TypeVar("R")


def guarded(method: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[G, P], R]:
    """A public call that uses the object's parts: counted in flight (so ``close`` waits for
    it before freeing them) and refused with StateError once close has begun."""

    @functools.wraps(method)
    def call(self: G, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._guard.call():
            return method(self, *args, **kwargs)

    return call
