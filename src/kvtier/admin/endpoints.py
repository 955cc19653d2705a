"""The admin API's request handler: routing, auth, query validation and the endpoints.

Each request runs in its own thread of the :class:`~kvtier.admin.server.AdminServer`'s
HTTP server, within bounds no client can stretch (:mod:`kvtier.admin.bounded`).

The dispatcher checks, in order: the path exists (404), the bearer token (401, except
``/health``), the query parameters (400: unknown, repeated, malformed or out of range), the
method (405), then calls the endpoint. Errors are JSON
``{"error": message}``; an exception no endpoint expects is logged with its traceback and
answered as a bare 500.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier.admin import lmcache_quota
from kvtier.admin.bounded import MAX_HANDLERS, REQUEST_TIMEOUT, BoundedHTTPServer
from kvtier.admin.dashboard import dashboard_html
from kvtier.config.tenant_quotas import check_tenant, parse_limit
from kvtier.engine import Engine
from kvtier.errors import ConfigError, KVTierError, StateError
from kvtier.storage.tenants import TenantQuotas, rows_dict

log = logging.getLogger("kvtier.admin.server")  # one logger for the whole admin API

MAX_REQUEST_ID = 256
MAX_BODY = 4096


class BadRequest(Exception):
    """A client error: answered with ``status`` and ``message``, never a traceback."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AdminBackend(Protocol):
    """What the handlers need of the server that owns them (:class:`kvtier.admin.server.
    AdminServer`): the endpoints sit below the server that starts them."""

    engine: Engine
    registry: CollectorRegistry

    def authorized(self, header: str | None, query_token: str | None) -> bool: ...

    def stats_payload(self) -> dict[str, Any]: ...

    def history_payload(self) -> list[dict[str, Any]]: ...


class AdminHTTPServer(BoundedHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        admin: AdminBackend,
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        max_handlers: int = MAX_HANDLERS,
    ) -> None:
        self.admin = admin
        super().__init__(
            address, Handler, request_timeout=request_timeout, max_handlers=max_handlers
        )


# path -> (method, allowed query parameters, handler)
Route = tuple[str, frozenset[str], Callable[["Handler", dict[str, str]], None]]


class Handler(BaseHTTPRequestHandler):
    server: AdminHTTPServer
    body = b""  # the request's body, read by _dispatch before the endpoint runs
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
        if self.server.dropped(self.connection):
            # Past its deadline (or closing): the headers may be cut short; answer nothing.
            self.close_connection = True
            return
        try:
            parts = urlsplit(self.path)
            route = ROUTES.get(parts.path) or _alias_route(parts.path, method)
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
            self.body = self._drain_body()
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

    def _drain_body(self) -> bytes:
        """The request's body (read whole, so the reply is clean): only LMCache's quota
        alias reads it."""
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        if not _is_decimal(length):
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}")
        if int(length) > MAX_BODY:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
        return self.rfile.read(int(length))

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

    def quotas(self, params: dict[str, str]) -> None:
        quotas = self._quotas()
        rows = {tenant: str(limit) for tenant, limit in quotas.rows().items()}
        usage = {
            tier.name: rows_dict(tier.tenants.rows()) if tier.tenants is not None else {}
            for tier in self.server.admin.engine.tiers()
        }
        self._send_json(HTTPStatus.OK, {"quotas": rows, "tiers": usage})

    def set_quota(self, params: dict[str, str]) -> None:
        """``PUT /quota?tenant=SALT&limit=2GiB`` (or ``25%``; ``none`` removes the row): what
        LMCache's ``PUT /api/quota/{cache_salt}`` does, for every tier of this engine."""
        if "tenant" not in params or "limit" not in params:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST,
                "tenant and limit are required: /quota?tenant=SALT&limit=2GiB (or 25%, or "
                "none to remove the row; tenant '*' is every tenant without a row)",
            )
        tenant, raw = params["tenant"], params["limit"]
        try:
            check_tenant("tenant", tenant)
            limit = None if raw.strip().lower() == "none" else parse_limit("limit", raw)
        except ConfigError as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, str(exc)) from None
        self._quotas().set(tenant, limit)
        log.info("admin API: tenant %r quota set to %s", tenant, limit or "none")
        self._send_json(HTTPStatus.OK, {"tenant": tenant, "limit": str(limit or "none")})

    def lmcache_quota(self, params: dict[str, str]) -> None:
        """LMCache's ``PUT`` / ``DELETE /api/quota/{cache_salt}``: :mod:`.lmcache_quota`."""
        try:
            tenant = lmcache_quota.salt_of_path(urlsplit(self.path).path)
            if self.command == "PUT":
                limit_gb, limit = lmcache_quota.limit_of_body(self.body)
        except lmcache_quota.AliasError as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, str(exc)) from None
        quotas, name = self._quotas(), lmcache_quota.path_salt(tenant)
        if self.command == "DELETE":
            had = tenant in quotas.rows()
            quotas.set(tenant, None)
            log.info("admin API (LMCache alias): tenant %r quota removed", tenant)
            self._send_json(HTTPStatus.OK, {"cache_salt": name, "status": _REMOVED[had]})
            return
        quotas.set(tenant, limit)
        log.info("admin API (LMCache alias): tenant %r quota set to %s", tenant, limit)
        self._send_json(HTTPStatus.OK, {"cache_salt": name, "limit_gb": limit_gb, "status": "ok"})

    def _quotas(self) -> TenantQuotas:
        """The engine's quota table (the one every tier's ledger reads)."""
        quotas = self.server.admin.engine.quotas()
        if quotas is not None:
            return quotas
        raise BadRequest(
            HTTPStatus.CONFLICT,
            "tenant quotas are off: set tenant_quotas in the config (e.g. {'*': '100%'} "
            "to start with no limit) to change them at run time",
        )

    def dashboard(self, params: dict[str, str]) -> None:
        self._send(HTTPStatus.OK, dashboard_html(), "text/html; charset=utf-8")


ROUTES: dict[str, Route] = {
    "/health": ("GET", frozenset(), Handler.health),
    "/metrics": ("GET", frozenset(), Handler.metrics),
    "/stats": ("GET", frozenset(), Handler.stats),
    "/history": ("GET", frozenset(), Handler.history),
    "/config": ("GET", frozenset(), Handler.config),
    "/leases": ("GET", frozenset(), Handler.leases),
    "/requests": ("GET", frozenset({"limit"}), Handler.requests),
    "/explain": ("GET", frozenset({"request_id"}), Handler.explain),
    "/clear": ("POST", frozenset(), Handler.clear),
    "/quotas": ("GET", frozenset(), Handler.quotas),
    "/quota": ("PUT", frozenset({"tenant", "limit"}), Handler.set_quota),
    "/": ("GET", frozenset(), Handler.dashboard),
}


_REMOVED = {True: "removed", False: "not_found"}  # LMCache's words for a DELETE's outcome


def _alias_route(path: str, method: str) -> Route | None:
    """LMCache's ``/api/quota/{cache_salt}`` (its salt in the path, so not in ROUTES)."""
    if not path.startswith(lmcache_quota.PREFIX):
        return None
    takes = method if method in lmcache_quota.METHODS else "PUT or DELETE"
    return (takes, frozenset(), Handler.lmcache_quota)


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
    if not _is_decimal(raw) or not low <= int(raw) <= high:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, f"{name} must be an integer in [{low}, {high}], got {raw!r}"
        )
    return int(raw)


def _is_decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit()`` also accepts '²' or '٣', which ``int()`` refuses
    (or, for '٣', reads as 3: a number the client never wrote in the form we document)."""
    return text.isascii() and text.isdigit()


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)
