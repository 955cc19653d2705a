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
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

GENERATE = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 * 1024 * 1024


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefiller", required=True, help="base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decoder", required=True, help="base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")


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
        upstream = (prefiller.rstrip("/"), decoder.rstrip("/"), timeout)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class _ProxyHandler(BaseHTTPRequestHandler):
    upstream: tuple[str, str, float]
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._relay(self.upstream[1] + self.path, None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.send_error(413, f"body over {MAX_BODY} bytes")
            return
        raw = self.rfile.read(length)
        if self.path not in GENERATE:
            self._relay(self.upstream[1] + self.path, raw)
            return
        try:
            body = json.loads(raw)
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            self.send_error(400, "the body must be a JSON object")
            return
        params = {"kvtier_transfer_id": f"kvtier-pd-{uuid.uuid4().hex}"}
        self._prefill(body, params)
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        self._relay(self.upstream[1] + self.path, json.dumps(body).encode())

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
