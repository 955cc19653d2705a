"""What an engine is made of, shared by the engine and its page view (package-private).

:class:`EngineCore` is the part of an :class:`~kvtier.engine.Engine` that more than one
module of this package uses: the call guard, the parts that exist only while it is open, the
keys of a request and the end of a request. The engine and ``engine.pages()`` both ask it;
neither reaches into the other::

    Engine       (engine.py) ──┐
                               ├──> EngineCore ──> OpenParts (manager, leases, loads, pool)
    EnginePages  (_pages.py) ──┘

Nothing outside :mod:`kvtier.engine` imports this module.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from kvtier.config import Config
from kvtier.engine._loads import RequestLoads
from kvtier.errors import StateError
from kvtier.keys import KeyChain, RequestKeys
from kvtier.lease import Lease, LeaseTable
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.memory.block_pool import BlockPool
from kvtier.observability.observer import Observer
from kvtier.request_salt import RequestSalt
from kvtier.storage.counters import EngineCounters
from kvtier.storage.manager import StorageManager
from kvtier.storage.plan import LookupPlan


@dataclass(frozen=True)
class OpenParts:
    """What ``Engine.open`` builds and ``close`` frees: the tiers, the requests' leases, how
    a hit is loaded, and the page memory under them."""

    manager: StorageManager
    leases: LeaseTable[LookupPlan]
    loads: RequestLoads
    pool: BlockPool


class EngineCore:
    """See the module docstring. One per engine, made with it."""

    def __init__(
        self, config: Config, keychain: KeyChain, counters: EngineCounters, observer: Observer
    ) -> None:
        self.config = config
        self.keychain = keychain
        self.counters = counters
        self.observer = observer
        self.guard = CallGuard("Engine")  # the lifecycle, and the public calls in flight
        self._parts: OpenParts | None = None

    def attach(self, parts: OpenParts) -> None:
        """``open``: the parts exist from now on (the guard opens after this)."""
        self._parts = parts

    def detach(self) -> OpenParts | None:
        """``close``, once the guard refuses new calls: the parts to free, or None when the
        engine never opened."""
        parts, self._parts = self._parts, None
        return parts

    def parts(self) -> OpenParts:
        """The open engine's parts, or StateError that says how to get an open one."""
        state = self.guard.state
        if state is not Lifecycle.OPEN:
            hint = (
                "call open() or use `with Engine(...)`"
                if state is Lifecycle.NEW
                else "it was closed"
            )
            raise StateError(f"Engine is {state.value}: {hint}")
        assert self._parts is not None
        return self._parts

    def call(self) -> AbstractContextManager[None]:
        """A call counted in flight: ``close`` waits for it before freeing the parts."""
        return self.guard.call()

    def keys_for(
        self, tokens: np.ndarray, salt: RequestSalt | None, lease: Lease[LookupPlan] | None
    ) -> RequestKeys:
        """The keys of ``tokens``: reused from the lease where it knows them (only chunks it
        does not know are hashed); the lease keeps them when they extend its tokens."""
        known = lease.keys if lease is not None else None
        if known is None:
            return RequestKeys(self.keychain, tokens, salt, self.config.save_unfull_chunk)
        made = known.for_tokens(tokens, salt)
        if (
            lease is not None
            and made is not known
            and salt == known.salt
            and len(tokens) > len(known.tokens)
            and np.array_equal(tokens[: len(known.tokens)], known.tokens)
        ):
            lease.keys = made  # the same prompt, longer: what a later store hashed
        return made

    def end_request(self, request_id: str) -> bool:
        """Release everything ``request_id`` holds and count it (its log line, its unused
        tokens). False when it held nothing."""
        leases = self.parts().leases
        lease = leases.get(request_id)
        ended = leases.end(request_id)
        if ended and lease is not None:
            unused = self.observer.on_request_end(lease)
            self.counters.add(requests=1, unused_tokens=unused)
        return ended
