"""The HTTP admin API and dashboard of one engine, on the standard library's http.server.

Lifecycle: ``AdminServer(engine, host, port, token)`` binds nothing; :meth:`AdminServer.open`
binds (``port`` 0 picks a free one; otherwise ``port`` .. ``port + PORT_ATTEMPTS - 1`` are
tried in turn), then serves from a background thread and samples the engine once a second
for the dashboard's history. :meth:`AdminServer.close` is idempotent and waits for requests in
flight, up to ``CLOSE_TIMEOUT`` (connections still held by clients are dropped first).
:class:`kvtier.service.Service` opens one after its engine when
``internal_api_server_enabled`` is set, and closes it before the engine; ``kvtier demo
--dashboard`` opens one explicitly.

Endpoints (served by :mod:`kvtier.admin.endpoints`; docs/operations.md has the details)::

    GET  /health            liveness, never needs the token
    GET  /metrics           Prometheus text format
    GET  /stats             engine.stats() + latency, TTFT and explain summaries (JSON)
    GET  /history           the sampled time series the dashboard draws
    GET  /config            the resolved config, secrets masked
    GET  /leases            open requests: what each holds and since when
    GET  /requests?limit=N  the most recent requests explain remembers
    GET  /explain?request_id=ID   per-chunk hit tier or miss reason (404: unknown id)
    POST /clear             drop unpinned entries of every tier; pinned ones stay
    GET  /                  the dashboard page (HTML, CSS and JS served inline)

Security: loopback unless configured otherwise. With a token, every endpoint but /health
needs ``Authorization: Bearer <token>`` (or ``?token=`` for a browser opening the page).
Bad input is a 4xx JSON error with a message; a bug is a 500 with no traceback in the body.
Bounds (``request_timeout``, ``max_handlers``) are in :mod:`kvtier.admin.endpoints`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from typing import Any

from kvtier.admin.bounded import MAX_HANDLERS, REQUEST_TIMEOUT
from kvtier.admin.endpoints import AdminHTTPServer
from kvtier.engine import Engine
from kvtier.errors import KVTierError, StateError
from kvtier.observability.metrics import engine_registry, pd_view

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 16
HISTORY_POINTS = 600  # ten minutes at one sample a second
CLOSE_TIMEOUT = 2.0  # longest close waits for requests in flight once their sockets are shut


class AdminServer:
    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        sample_interval: float = 1.0,
        request_timeout: float = REQUEST_TIMEOUT,
        max_handlers: int = MAX_HANDLERS,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port_start = port
        self.token = token or None
        self.sample_interval = sample_interval
        self.request_timeout = request_timeout
        self.max_handlers = max_handlers
        self.registry = engine_registry(engine)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._history_lock = threading.Lock()
        self._httpd: AdminHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> AdminServer:
        """Bind and serve in background threads. Raises OSError when no port is free."""
        with self._lock:
            if self._httpd is not None:
                return self
            self._httpd = self._bind()
            self._stopping.clear()
            serve = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name="kvtier-admin",
                daemon=True,
            )
            sample = threading.Thread(
                target=self._sample_loop, name="kvtier-admin-sampler", daemon=True
            )
            self._threads = [serve, sample]
            for thread in self._threads:
                thread.start()
        log.info("kvtier admin API on %s", self.url)
        return self

    def close(self) -> None:
        """Stop serving; drop the connections clients still hold and wait for requests in
        flight, at most ``CLOSE_TIMEOUT`` seconds. Idempotent."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
            threads, self._threads = self._threads, []
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()  # the serve loop ends within its poll interval
        stuck = httpd.drop_connections(CLOSE_TIMEOUT)
        httpd.server_close()
        if stuck:
            log.warning("admin API closed with %d requests still running", len(stuck))
        for thread in threads:
            thread.join()

    def __enter__(self) -> AdminServer:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise StateError("the admin server is not running")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def _bind(self) -> AdminHTTPServer:
        ports = (
            [0] if self.port_start == 0 else range(self.port_start, self.port_start + PORT_ATTEMPTS)
        )
        last: OSError | None = None
        for port in ports:
            if port > 65535:
                break
            try:
                return AdminHTTPServer(
                    (self.host, port),
                    self,
                    request_timeout=self.request_timeout,
                    max_handlers=self.max_handlers,
                )
            except OSError as exc:
                last = exc
        raise OSError(f"no free admin port from {self.port_start} on {self.host}: {last}")

    # -- data for the endpoints --------------------------------------------------------------
    def stats_payload(self) -> dict[str, Any]:
        engine = self.engine
        stats = engine.stats()
        stats["engine"] = {
            "model_name": engine.fingerprint.model_name,
            "fingerprint": engine.fingerprint.hex(),
            "chunk_size": engine.config.chunk_size,
            "chunk_bytes": engine.chunk_bytes,
            "layout": engine.layout.describe(),
        }
        stats["observability"] = engine.observer.snapshot()
        stats["pd"] = pd_view(stats)
        stats["time"] = time.time()
        return stats

    def sample(self) -> dict[str, Any]:
        """One point of the dashboard's history (also taken by the sampler thread)."""
        stats = self.engine.stats()
        ttft = self.engine.observer.snapshot()["ttft"]
        pd = pd_view(stats) or {}
        point = {
            "time": time.time(),
            "lookup_tokens": stats["lookup_tokens"],
            "hit_tokens": stats["hit_tokens"],
            "open_requests": stats["open_requests"],
            "pinned_bytes": stats["pinned_bytes"],
            "ttft_saved_seconds": ttft["saved_seconds_estimate"],
            "tier_used_bytes": {n: t["used_bytes"] for n, t in stats["tiers"].items()},
            "pd_buffer_used_bytes": pd.get("buffer_used_bytes"),
        }
        with self._history_lock:
            self.history.append(point)
        return point

    def history_payload(self) -> list[dict[str, Any]]:
        with self._history_lock:
            return list(self.history)

    def _sample_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sample()
            except KVTierError as exc:  # engine closing, or a tier down: skip this sample
                log.debug("admin history sample skipped: %s", exc)
            except Exception:  # a bug: logged, and the sampler keeps going
                log.exception("admin history sampler failed")
            self._stopping.wait(self.sample_interval)

    # -- auth --------------------------------------------------------------------------------
    def authorized(self, header: str | None, query_token: str | None) -> bool:
        if self.token is None:
            return True
        expected = self.token.encode()
        if header is not None and header.startswith("Bearer "):
            given = header[len("Bearer ") :].strip().encode()
            return hmac.compare_digest(given, expected)
        return query_token is not None and hmac.compare_digest(query_token.encode(), expected)
