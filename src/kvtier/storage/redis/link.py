"""The remote tier's link to Redis: one client, its health, and reconnecting with backoff.

States::

            open() reaches the server                 a call fails with a connection error
    NEW ─────────────────────────────────► UP ──────────────────────────────────────────┐
     │                                     ▲                                             │
     │ open() cannot reach it              │ the reconnect thread's PING answers         ▼
     └─────────────────────────────────────┴──────────────────────────────────────── DOWN
                  (one warning)                  (retries after 0.1 s, 0.2 s, ... up to 2 s)

While DOWN every call fails at once with :class:`TierUnavailable` (the tier turns that into a
miss or a dropped write) instead of waiting on a dead socket. The transition to DOWN logs one
warning; coming back logs one info line. Every socket operation is bounded by
``timeout_s`` (``blocking_timeout_secs``): a stalled server costs at most that long per call.

Connections: at most ``max_connections`` calls run at once (a :class:`ConnectionGate`); a
call beyond that waits for one to finish, up to ``timeout_s``, and gives up at once if the
link goes DOWN meanwhile. A wait that runs out is a miss (:class:`TierUnavailable`), counted
in ``busy_timeouts``, and never an outage: the server is fine, this process is just busy.
redis-py's own pools are sized above the gate (a call may follow a cluster redirect on a
second connection), so its ``MaxConnectionsError`` should not happen; if it does, it is
treated the same way, never as the server being down.

Error mapping (the boundary): redis connection/timeout errors and ``OSError`` become
:class:`TierUnavailable` (and take the link DOWN); any other redis error becomes
:class:`TierError`. No redis exception leaves :meth:`RedisLink.call`.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvtier.config.remote_url import RemoteTarget
from kvtier.errors import StateError, TierError, TierUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0

# Errors that mean "the server cannot be reached right now" rather than "it said no".
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    RedisClusterException,
    OSError,
    socket.timeout,
)


class ConnectionGate:
    """At most ``size`` holders at once; the rest wait, bounded, and leave early when told.

    ``wake()`` rouses every waiter so it can re-check ``give_up`` (the link going DOWN or
    closing): nobody sits out the whole timeout for a server already known to be gone."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self, timeout: float, give_up: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._in_use >= self.size:
                left = deadline - time.monotonic()
                if left <= 0 or give_up():
                    return False
                self._cond.wait(left)
            self._in_use += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._in_use -= 1
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


def pool_size(gate_size: int) -> int:
    """redis-py's per-server pool: two connections per gated call (one may follow a cluster
    redirect while the first is still held) plus one for the reconnect thread's PING.
    Connections are opened on demand, so the ceiling costs nothing until it is used."""
    return 2 * gate_size + 1


def make_client(
    target: RemoteTarget, timeout_s: float, max_connections: int, tls_ca_file: str | None = None
) -> Any:
    """A redis-py client for ``target`` with every socket bounded by ``timeout_s`` and no
    hidden retries (a retry would multiply the time a dead server costs each call).

    For a cluster this contacts the startup nodes (redis-py reads the slot map in the
    constructor), so it raises when none answers."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "username": target.username,
        "password": target.password,
        "retry": Retry(NoBackoff(), 0),
    }
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, max_connections=max_connections, **common)
    if target.kind == "unix":
        pool: redis.ConnectionPool = redis.ConnectionPool(
            connection_class=redis.UnixDomainSocketConnection,
            path=target.path,
            db=target.db,
            max_connections=max_connections,
            **common,
        )
    else:
        host, port = target.nodes[0]
        tls: dict[str, Any] = {}
        if target.tls:
            tls = {"connection_class": redis.SSLConnection, "ssl_ca_certs": tls_ca_file}
        pool = redis.ConnectionPool(
            **tls,
            host=host,
            port=port,
            db=target.db,
            max_connections=max_connections,
            **common,
        )
    return redis.Redis(connection_pool=pool)


def ping(client: Any) -> None:
    """Raise unless the server (every cluster master) answers."""
    if isinstance(client, RedisCluster):
        client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.ping()


class RedisLink:
    """Owns the client and the UP/DOWN state; see the module docstring."""

    def __init__(
        self,
        target: RemoteTarget,
        timeout_s: float,
        max_connections: int = 16,
        name: str = "redis",
        tls_ca_file: str | None = None,
    ) -> None:
        self.target = target
        self.tls_ca_file = tls_ca_file
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.gate = ConnectionGate(max_connections)
        self.name = name
        self._client: Any = None
        self._lock = threading.Lock()
        self._up = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        self.outages = 0
        self.busy_timeouts = 0

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Try to connect once; start the reconnect thread either way. Never raises for an
        unreachable server: the link starts DOWN with one warning instead."""
        if self._thread is not None:
            raise StateError(f"{self.name} link already open")
        try:
            self._connect()
        except TierUnavailable as exc:
            self.outages += 1
            log.warning(
                "remote tier %s is unreachable at start (%s); it stays disabled and reconnects "
                "in the background",
                self.target.describe(),
                exc,
            )
        self._thread = threading.Thread(
            target=self._reconnect_loop, name=f"kvtier-{self.name}-reconnect", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.gate.wake()
        if self._thread is not None:
            self._thread.join(self.timeout_s * 2 + 5)
            self._thread = None
        self._up.clear()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except UNREACHABLE + (RedisError,):
                pass

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    def wait_up(self, timeout: float) -> bool:
        return self._up.wait(timeout)

    # -- calls -----------------------------------------------------------------------------
    def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` on one of the gate's connections, translating redis errors (see
        the module docstring)."""
        client = self._client
        if not self._up.is_set() or client is None:
            raise TierUnavailable(f"remote tier {self.target.describe()} is down")
        if not self.gate.acquire(self.timeout_s, self._gone):
            if not self._up.is_set() or self._stop.is_set():
                raise TierUnavailable(f"remote tier {self.target.describe()} is down")
            raise self._busy(None)
        try:
            return fn(client)
        except MaxConnectionsError as exc:  # a ConnectionError subclass: test it first
            raise self._busy(exc) from exc
        except UNREACHABLE as exc:
            self.mark_down(exc)
            raise TierUnavailable(f"remote tier {self.target.describe()}: {exc}") from exc
        except RedisError as exc:
            raise TierError(f"remote tier {self.target.describe()}: {exc}") from exc
        finally:
            self.gate.release()

    def _gone(self) -> bool:
        return not self._up.is_set() or self._stop.is_set()

    def _busy(self, exc: BaseException | None) -> TierUnavailable:
        """Every connection was busy for the whole timeout: a miss, not an outage."""
        with self._lock:
            self.busy_timeouts += 1
            first = self.busy_timeouts == 1
        why = f" ({exc})" if exc is not None else ""
        message = (
            f"remote tier {self.target.describe()}: all {self.gate.size} connections stayed "
            f"busy for {self.timeout_s:g}s{why}; raise extra_config.remote_connections"
        )
        if first:  # later ones are counted (busy_timeouts), not logged each time
            log.warning("%s", message)
        return TierUnavailable(message)

    def mark_down(self, exc: BaseException) -> None:
        """Called on a connection error: one warning per outage, then the reconnect thread
        takes over."""
        with self._lock:
            if not self._up.is_set():
                return
            self._up.clear()
            self.outages += 1
        self.gate.wake()
        log.warning(
            "remote tier %s failed (%s: %s); treating it as a miss until it answers again",
            self.target.describe(),
            type(exc).__name__,
            exc,
        )
        self._wake.set()

    # -- reconnecting ----------------------------------------------------------------------
    def _connect(self) -> None:
        """Create the client when there is none, and PING; mark UP when it answers."""
        try:
            with self._lock:
                if self._client is None:
                    self._client = make_client(
                        self.target, self.timeout_s, pool_size(self.gate.size), self.tls_ca_file
                    )
                client = self._client
            ping(client)
        except UNREACHABLE + (RedisError,) as exc:
            raise TierUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self._up.set()

    def _reconnect_loop(self) -> None:
        delay = BACKOFF_FIRST_S
        while not self._stop.is_set():
            if self._up.is_set():
                self._wake.wait()  # until mark_down (or close) wakes us
                self._wake.clear()
                delay = BACKOFF_FIRST_S
                continue
            # Jitter, so a fleet of engines does not reconnect in lockstep after an outage.
            if self._stop.wait(delay * random.uniform(0.8, 1.2)):
                return
            try:
                self._connect()
            except TierUnavailable as exc:
                log.debug("remote tier still down: %s", exc)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            self.reconnects += 1
            log.info("remote tier %s is back", self.target.describe())
