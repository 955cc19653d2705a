"""The HTTP admin API and dashboard of one engine, on the standard library's http.server.

Lifecycle: ``AdminServer(engine, host, port, token)`` binds nothing; :meth:`AdminServer.start`
binds (``port`` 0 picks a free one; otherwise ``port`` .. ``port + PORT_ATTEMPTS - 1`` are
tried in turn), then serves from a background thread and samples the engine once a second
for the dashboard's history. :meth:`AdminServer.stop` is idempotent and waits for requests in
flight. ``Engine.open()`` starts one when ``internal_api_server_enabled`` is set and
``Engine.close()`` stops it; ``kvtier demo --dashboard`` and ``kvtier serve-admin`` start one
explicitly.

Endpoints (docs/operations.md has the details)::

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
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.admin.dashboard import dashboard_html
from kvtier.errors import KVTierError, StateError
from kvtier.observability.metrics import engine_registry, pd_view

if TYPE_CHECKING:
    from kvtier.engine import Engine

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 16
HISTORY_POINTS = 600  # ten minutes at one sample a second
MAX_REQUEST_ID = 256
MAX_BODY = 4096


class BadRequest(Exception):
    """A client error: answered with ``status`` and ``message``, never a traceback."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AdminServer:
    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        sample_interval: float = 1.0,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port_start = port
        self.token = token or None
        self.sample_interval = sample_interval
        self.registry = engine_registry(engine)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._history_lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> AdminServer:
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

    def stop(self) -> None:
        """Stop serving and wait for requests in flight. Idempotent."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
            threads, self._threads = self._threads, []
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()  # joins handler threads (block_on_close)
        for thread in threads:
            thread.join()

    def __enter__(self) -> AdminServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

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

    def _bind(self) -> _HTTPServer:
        ports = (
            [0] if self.port_start == 0 else range(self.port_start, self.port_start + PORT_ATTEMPTS)
        )
        last: OSError | None = None
        for port in ports:
            if port > 65535:
                break
            try:
                return _HTTPServer((self.host, port), self)
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
            except StateError:
                pass  # engine closing: the server is about to stop
            except Exception:  # a sampler must not die silently mid-run
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


def start_for_engine(engine: Engine) -> AdminServer | None:
    """Start the server the engine's config asks for. A port that cannot be bound is logged
    and the engine runs without its admin API (the cache itself is unaffected)."""
    cfg = engine.config
    server = AdminServer(
        engine, cfg.internal_api_server_host, cfg.internal_api_server_port_start, cfg.admin_token
    )
    try:
        return server.start()
    except OSError as exc:
        log.error("kvtier admin API not started: %s", exc)
        return None


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close waits for handlers, so stop() leaves nothing running

    def __init__(self, address: tuple[str, int], admin: AdminServer) -> None:
        self.admin = admin
        super().__init__(address, _Handler)


# path -> (method, allowed query parameters, handler)
Route = tuple[str, frozenset[str], Callable[["_Handler", dict[str, str]], None]]


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 10  # seconds a silent client may hold a handler thread
    server_version = "kvtier-admin"
    sys_version = ""

    # -- dispatch ----------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_HEAD(self) -> None:
        self._send_json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "HEAD is not supported"})

    def _dispatch(self, method: str) -> None:
        try:
            parts = urlsplit(self.path)
            route = ROUTES.get(parts.path)
            if route is None:
                raise BadRequest(HTTPStatus.NOT_FOUND, f"no endpoint {parts.path!r}")
            want_method, allowed, handler = route
            params = _parse_query(parts.query, allowed | {"token"})
            if parts.path != "/health" and not self.server.admin.authorized(
                self.headers.get("Authorization"), params.get("token")
            ):
                self._send_json(
                    HTTPStatus.UNAUTHORIZED,
                    {"error": "missing or wrong bearer token"},
                    {"WWW-Authenticate": 'Bearer realm="kvtier"'},
                )
                return
            if method != want_method:
                raise BadRequest(
                    HTTPStatus.METHOD_NOT_ALLOWED, f"{parts.path} takes {want_method}, not {method}"
                )
            self._drain_body()
            handler(self, params)
        except BadRequest as exc:
            self._send_json(exc.status, {"error": exc.message})
        except StateError as exc:
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"engine not open: {exc}"})
        except KVTierError as exc:  # a tier is down (e.g. Redis unreachable during /clear)
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except Exception:
            # A bug: logged here with its traceback, answered without one.
            log.exception("admin API bug on %s %s", method, self.path)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error (logged)"})

    def _drain_body(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None:
            return
        if not length.isdigit():
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}")
        if int(length) > MAX_BODY:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
        self.rfile.read(int(length))  # no endpoint takes a body; read it so the reply is clean

    # -- responses ---------------------------------------------------------------------------
    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_json(
        self, status: HTTPStatus, payload: object, extra: dict[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, default=_json_default, allow_nan=False).encode()
        self._send(status, body, "application/json", extra)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Malformed request lines and oversized headers: JSON like everything else, with a
        # status line even when the request line was too broken to name an HTTP version.
        self.close_connection = True
        self.request_version = "HTTP/1.0"
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._send_json(HTTPStatus(code), {"error": message or HTTPStatus(code).phrase})

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin %s - %s", self.address_string(), format % args)

    # -- endpoints ---------------------------------------------------------------------------
    def health(self, params: dict[str, str]) -> None:
        state = self.server.admin.engine.state.value
        status = HTTPStatus.OK if state == "open" else HTTPStatus.SERVICE_UNAVAILABLE
        self._send_json(status, {"status": "ok" if state == "open" else state})

    def metrics(self, params: dict[str, str]) -> None:
        self._send(HTTPStatus.OK, generate_latest(self.server.admin.registry), CONTENT_TYPE_LATEST)

    def stats(self, params: dict[str, str]) -> None:
        self._send_json(HTTPStatus.OK, self.server.admin.stats_payload())

    def history(self, params: dict[str, str]) -> None:
        self._send_json(HTTPStatus.OK, {"points": self.server.admin.history_payload()})

    def config(self, params: dict[str, str]) -> None:
        cfg = self.server.admin.engine.config
        self._send_json(HTTPStatus.OK, {"config": cfg.as_dict(), "origin": dict(cfg.origin)})

    def leases(self, params: dict[str, str]) -> None:
        now = time.time()
        rows = [
            {
                "request_id": info.request_id,
                "age_s": info.age_s,
                "since": now - info.age_s,
                "pinned_pages": info.pinned_pages,
                "pinned_bytes": info.pinned_bytes,
                "holds": list(info.holds),
            }
            for info in sorted(self.server.admin.engine.leases(), key=lambda i: -i.age_s)
        ]
        self._send_json(HTTPStatus.OK, {"leases": rows})

    def requests(self, params: dict[str, str]) -> None:
        limit = _int_param(params, "limit", default=50, low=1, high=1000)
        recent = self.server.admin.engine.observer.explain.recent(limit)
        self._send_json(HTTPStatus.OK, {"requests": recent})

    def explain(self, params: dict[str, str]) -> None:
        request_id = params.get("request_id")
        if not request_id:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, "request_id is required: /explain?request_id=ID"
            )
        if len(request_id) > MAX_REQUEST_ID:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"request_id is over {MAX_REQUEST_ID} characters"
            )
        explain = self.server.admin.engine.observer.explain
        if not explain.enabled:
            raise BadRequest(
                HTTPStatus.NOT_FOUND, "explain is off (extra_config.explain_requests: 0)"
            )
        record = explain.get(request_id)
        if record is None:
            raise BadRequest(
                HTTPStatus.NOT_FOUND,
                f"no recent lookup for request {request_id!r} "
                f"(the last {explain.capacity} are kept)",
            )
        self._send_json(HTTPStatus.OK, record)

    def clear(self, params: dict[str, str]) -> None:
        dropped = self.server.admin.engine.clear()
        self._send_json(HTTPStatus.OK, {"dropped": dropped})

    def dashboard(self, params: dict[str, str]) -> None:
        self._send(HTTPStatus.OK, dashboard_html(), "text/html; charset=utf-8")


ROUTES: dict[str, Route] = {
    "/health": ("GET", frozenset(), _Handler.health),
    "/metrics": ("GET", frozenset(), _Handler.metrics),
    "/stats": ("GET", frozenset(), _Handler.stats),
    "/history": ("GET", frozenset(), _Handler.history),
    "/config": ("GET", frozenset(), _Handler.config),
    "/leases": ("GET", frozenset(), _Handler.leases),
    "/requests": ("GET", frozenset({"limit"}), _Handler.requests),
    "/explain": ("GET", frozenset({"request_id"}), _Handler.explain),
    "/clear": ("POST", frozenset(), _Handler.clear),
    "/": ("GET", frozenset(), _Handler.dashboard),
}


def _parse_query(query: str, allowed: frozenset[str]) -> dict[str, str]:
    try:
        pairs = parse_qs(
            query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16
        )
    except ValueError as exc:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"malformed query string: {exc}") from None
    out: dict[str, str] = {}
    for name, values in pairs.items():
        if name not in allowed:
            accepted = ", ".join(sorted(allowed - {"token"})) or "none"
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"unknown parameter {name!r} (accepted: {accepted})"
            )
        if len(values) != 1:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"parameter {name!r} given {len(values)} times"
            )
        out[name] = values[0]
    return out


def _int_param(params: dict[str, str], name: str, *, default: int, low: int, high: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, f"{name} must be an integer in [{low}, {high}], got {raw!r}"
        )
    return int(raw)


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)
