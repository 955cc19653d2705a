"""``kvtier pd-proxy``: an OpenAI-compatible front for a prefiller and a decoder vLLM.

The standard disaggregated-prefill pattern, for vLLM instances running KVTierConnector with
``kv_role`` ``kv_producer`` (the prefiller, ``pd_role: sender``) and ``kv_consumer`` (the
decoder, ``pd_role: receiver``)::

    client ──POST /v1/completions──▶ proxy
        1. to the prefiller: the same body, max_tokens=1, no stream, kv_transfer_params
           {"kvtier_transfer_id": id}; its KV chunks go straight into the decoder's buffer
           before it answers
        2. to the decoder: the client's body with the same kv_transfer_params; its answer
           (streamed or not) goes back to the client as it arrives

A prefiller that fails or times out is logged and skipped: the decoder then prefills the
prompt itself, so the client still gets its answer. Other paths (``/v1/models``,
``/health``) go to the decoder.

Every request is checked before any work is done (so a bad one never costs a prefill or a
decoder reservation), and answered with a JSON error (``{"error": {"message", "code"}}``)::

    Content-Length missing, negative or not an integer   400 (411 when missing)
    body over MAX_BODY bytes                              413
    headers and body not in within REQUEST_TIMEOUT_S      408, the connection closed
    a generate body that is not a JSON object, or whose
    kv_transfer_params is not an object                   400
    MAX_CONNECTIONS connections already open              503

Bounds per connection: REQUEST_TIMEOUT_S for the whole request (headers and body; a byte at
a time does not extend it; a kept-alive connection idle that long is closed the same way),
and at most MAX_CONNECTIONS connections (threads) at once. Why http.server and not an ASGI server:
vLLM brings uvicorn, but kvtier does not depend on vLLM, the proxy's job is one blocking
relay per request, and these checks are a few lines; ``vllm-router`` may replace it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtier.config.parsers import integer, positive_float
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

GENERATE = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 * 1024 * 1024
REQUEST_TIMEOUT_S = 30.0  # headers and body of one request
MAX_CONNECTIONS = 64


def _checked(parse: Callable[[str, object], Any], key: str) -> Callable[[str], Any]:
    """An argparse type from a config parser: the same rule and message as the config key."""

    def check(raw: str) -> Any:
        try:
            return parse(key, raw)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.allowed) from None

    return check


def base_url(raw: str) -> str:
    """An http(s) URL with a host: what the proxy can send requests to."""
    parsed = urllib.parse.urlsplit(raw)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8100"
        )
    try:
        parsed.port  # noqa: B018  (raises on a port out of range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r}: {exc}") from None
    return raw.rstrip("/")


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefiller", required=True, type=base_url, help="base URL, e.g. http://127.0.0.1:8100"
    )
    parser.add_argument(
        "--decoder", required=True, type=base_url, help="base URL, e.g. http://127.0.0.1:8200"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_checked(integer(0, 65535), "--port"), default=8000)
    parser.add_argument(
        "--timeout",
        type=_checked(positive_float(86400.0), "--timeout"),
        default=600.0,
        help="seconds per upstream call",
    )


def run(args: argparse.Namespace) -> int:
    server = make_server(args.prefiller, args.decoder, args.host, args.port, args.timeout)
    print(f"kvtier pd-proxy on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def make_server(
    prefiller: str, decoder: str, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0
) -> ThreadingHTTPServer:
    """The proxy, not yet serving (``serve_forever`` it; ``port=0`` picks a free one)."""

    class Handler(_ProxyHandler):
        upstream = (base_url(prefiller), base_url(decoder), timeout)

    server = _BoundedServer((host, port), Handler)
    server.daemon_threads = True
    return server


class _BoundedServer(ThreadingHTTPServer):
    """At most MAX_CONNECTIONS connections (threads); more get a 503 and are closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_error_response(503, "pd-proxy: too many connections"))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _error_response(code: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {code} Error\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _ProxyHandler(BaseHTTPRequestHandler):
    upstream: tuple[str, str, float]
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT_S  # per read; the watchdog bounds the whole request

    def handle_one_request(self) -> None:
        # The watchdog bounds the whole request (headers and body): a client that sends a
        # byte at a time is cut off at REQUEST_TIMEOUT_S, whatever the per-read timeout.
        self._watchdog = threading.Timer(REQUEST_TIMEOUT_S, self._expire)
        self._watchdog.daemon = True
        self._expired = False
        self._watchdog.start()
        try:
            super().handle_one_request()
        finally:
            self._watchdog.cancel()

    def _expire(self) -> None:
        self._expired = True
        with contextlib.suppress(OSError):
            self.connection.sendall(_error_response(408, "pd-proxy: request not received in time"))
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.command != "POST":
            self._watchdog.cancel()  # nothing more to read
        return ok

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error as JSON (http.server's own ones too: 400 bad request line, 431...)."""
        with contextlib.suppress(OSError):
            self.wfile.write(_error_response(code, f"pd-proxy: {message or code}"))
        self.close_connection = True

    def do_GET(self) -> None:
        self._relay(self.upstream[1] + self.path, None)

    def do_POST(self) -> None:
        raw = self._read_body()
        if raw is None:
            return
        if self.path not in GENERATE:
            self._relay(self.upstream[1] + self.path, raw)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.send_error(400, "the body must be a JSON object")
            return
        extra = body.get("kv_transfer_params")
        if extra is not None and not isinstance(extra, dict):
            self.send_error(400, "kv_transfer_params must be a JSON object")
            return
        params = {"kvtier_transfer_id": f"kvtier-pd-{uuid.uuid4().hex}"}
        self._prefill(body, params)
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        self._relay(self.upstream[1] + self.path, json.dumps(body).encode())

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be had."""
        declared = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            self.send_error(400, "chunked request bodies are not supported; send Content-Length")
            return None
        if declared is None:
            self.send_error(411, "Content-Length is required")
            return None
        if not declared.strip().isdigit():
            self.send_error(400, f"Content-Length {declared!r} is not a non-negative integer")
            return None
        length = int(declared)
        if length > MAX_BODY:
            self.send_error(413, f"body of {length} bytes is over {MAX_BODY}")
            return None
        try:
            raw = self.rfile.read(length)
        except OSError:
            raw = b""
        self._watchdog.cancel()
        if len(raw) < length:
            if not self._expired:
                self.send_error(408, f"body ended after {len(raw)} of {length} bytes")
            self.close_connection = True
            return None
        return raw

    def _prefill(self, body: dict[str, Any], params: dict[str, str]) -> None:
        prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
        prefill.pop("max_completion_tokens", None)
        prefill.pop("stream_options", None)
        url = self.upstream[0] + self.path
        try:
            with _open(url, json.dumps(prefill).encode(), self.upstream[2]) as response:
                response.read()
        except (OSError, urllib.error.URLError) as exc:
            log.warning("pd-proxy: prefiller failed (%s); the decoder prefills itself", exc)

    def _relay(self, url: str, data: bytes | None) -> None:
        try:
            response = _open(url, data, self.upstream[2])
        except urllib.error.HTTPError as exc:
            response = exc  # an HTTP error answer is relayed as it is
        except (OSError, urllib.error.URLError) as exc:
            self.send_error(502, f"decoder unreachable: {exc}")
            return
        with response:
            self.send_response(response.status)
            ctype = response.headers.get("Content-Type", "application/json")
            self.send_header("Content-Type", ctype)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()  # a streamed answer reaches the client as it comes
            self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("pd-proxy: " + format, *args)


def _open(url: str, data: bytes | None, timeout: float) -> Any:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)
