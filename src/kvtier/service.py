"""A node: a cache with the servers its config asks for, opened in order and closed in reverse.

:class:`kvtier.engine.Engine` is the cache alone: it binds no port and starts no server, so a
library user (a connector, a test, a benchmark) gets exactly what it asked for. A process that
*is* a kvtier node (a vLLM worker, ``kvtier serve-admin``, a PD decoder, each model of the kvtier
server) opens a :class:`Service`::

    open:   cache  ->  admin API (internal_api_server_enabled)  ->  PD receiver (pd_role receiver)
    close:  PD receiver  ->  admin API  ->  cache

so nothing serves a cache that is not open yet or any more. An admin port that cannot be
bound is logged and the service runs without it (the cache itself is unaffected); a PD port
that cannot be bound fails ``open`` (a decoder that cannot receive is no decoder).

A Service holds its cache, ``service.cache`` (:class:`kvtier.cache.KVCache`, the surface
connectors call): an Engine it builds in this process, or the cache it is given (``cache=``,
e.g. a :class:`~kvtier.server.client.ServerClient` of the host's kvtier server, which serves
its own admin API; no PD receiver then). ``local_engine`` is the Engine when it runs here
(None through a server), for what only an in-process engine offers (PD hooks, the page API,
``tier(name)``). So whoever needs "the cache this process runs" opens one Service and never
assembles engine, admin API and receiver by hand.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Self, Unpack

from kvtier.admin.server import AdminServer
from kvtier.cache import CacheIdentity, KVCache
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import StateError
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle, Opens
from kvtier.pd.receiver import PDReceiver
from kvtier.storage.base import Tier

log = logging.getLogger(__name__)


class Service(Opens):
    """A cache (an :class:`Engine`, or a client of the kvtier server), its admin API and its
    PD receiver, as one lifecycle."""

    def __init__(
        self,
        config: Config | None,
        layout: KVLayout,
        *,
        page_memory: Callable[[int], mmap.mmap] | None = None,
        lower_tiers: Sequence[Tier] | None = None,
        cache: KVCache | None = None,
        **identity: Unpack[CacheIdentity],
    ) -> None:
        """``identity``: the engine's (:class:`kvtier.cache.CacheIdentity`). ``page_memory``,
        ``lower_tiers``: as :class:`Engine`'s (the kvtier server passes shared memory; a test
        passes ready-made tiers). ``cache``: an unopened cache to hold
        instead of an engine built here (a client of the kvtier server); the Service opens
        and closes it."""
        self.cache: KVCache
        self.local_engine: Engine | None = None
        if cache is not None:
            self.cache = cache
            self.local_engine = cache if isinstance(cache, Engine) else None
        else:
            self.cache = self.local_engine = Engine(
                config, layout, page_memory=page_memory, lower_tiers=lower_tiers, **identity
            )
        self.config = self.cache.config
        self.admin: AdminServer | None = None
        self.receiver: PDReceiver | None = None
        self._state = Lifecycle.NEW
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        """The engine this process runs; StateError for a service of a kvtier server."""
        if self.local_engine is None:
            raise StateError(
                f"this Service holds a {type(self.cache).__name__}: no engine runs here"
            )
        return self.local_engine

    def open(self) -> Self:
        with self._lock:
            if self._state is Lifecycle.OPEN:
                return self
            if self._state is Lifecycle.CLOSED:
                raise StateError("this Service is closed; create a new one")
            self.cache.open()
            try:
                engine = self.local_engine
                if engine is not None:  # a kvtier server serves its own admin API
                    self.admin = open_admin(engine)
                    if engine.receiver_host().pd_buffer is not None:  # pd_role receiver
                        self.receiver = PDReceiver.for_engine(engine).open()
            except BaseException:
                self._close_parts()
                raise
            self._state = Lifecycle.OPEN
            return self

    def close(self) -> None:
        """Close the receiver, the admin API, then the cache. Idempotent."""
        with self._lock:
            if self._state is Lifecycle.CLOSED:
                return
            self._state = Lifecycle.CLOSED
            self._close_parts()

    def _close_parts(self) -> None:
        receiver, self.receiver = self.receiver, None
        admin, self.admin = self.admin, None
        try:
            if receiver is not None:
                receiver.close()
            if admin is not None:
                admin.close()
        finally:
            self.cache.close()

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def admin_url(self) -> str | None:
        """Base URL of the admin API while it runs (``internal_api_server_enabled``)."""
        return self.admin.url if self.admin is not None and self.admin.running else None


def open_admin(engine: Engine) -> AdminServer | None:
    """The admin API ``engine``'s config asks for (``internal_api_server_enabled``), open,
    or None. A port that cannot be bound is logged: the cache never fails for its dashboard.
    For any process that owns an open engine (a Service, a vLLM worker)."""
    cfg = engine.config
    if not cfg.internal_api_server_enabled:
        return None
    server = AdminServer(
        engine, cfg.internal_api_server_host, cfg.internal_api_server_port_start, cfg.admin_token
    )
    try:
        return server.open()
    except OSError as exc:
        log.error("kvtier admin API not started: %s", exc)
        return None
