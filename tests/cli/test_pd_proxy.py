"""``kvtier pd-proxy`` checks every request before doing any work, answers JSON errors,
bounds each connection's time and the number of connections, and validates its arguments.
The prefiller and decoder are small real HTTP servers that record what reaches them."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtier.cli import pd_proxy
from kvtier.cli.main import main


class Upstream:
    """A fake vLLM: answers every POST with a JSON completion, recording the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                upstream.bodies.append(json.loads(self.rfile.read(length)))
                data = json.dumps({"choices": [{"text": "ok"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    prefiller, decoder = Upstream(), Upstream()
    yield prefiller, decoder
    prefiller.close()
    decoder.close()


@pytest.fixture
def proxy(upstreams: tuple[Upstream, Upstream]) -> Iterator[int]:
    server = pd_proxy.make_server(upstreams[0].url, upstreams[1].url, timeout=10.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def exchange(port: int, raw: bytes, wait: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Send ``raw`` as is; the status and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, body = data.partition(b"\r\n\r\n")
                length = [
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if length and len(body) >= length[0]:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(path: str, body: bytes, length: str | None = None) -> bytes:
    size = str(len(body)) if length is None else length
    header = f"Content-Length: {size}\r\n" if size != "" else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{header}"
        f"Connection: close\r\n\r\n"
    ).encode() + body


def test_a_good_request_prefills_then_decodes_with_one_transfer_id(
    proxy: int, upstreams: tuple[Upstream, Upstream]
) -> None:
    prefiller, decoder = upstreams
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "kv_transfer_params": {"x": 1}}
    with socket.create_connection(("127.0.0.1", proxy), timeout=10) as sock:
        sock.sendall(post("/v1/completions", json.dumps(body).encode()))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b'"ok"' in data
    (sent_prefill,), (sent_decode,) = prefiller.bodies, decoder.bodies
    assert sent_prefill["max_tokens"] == 1
    transfer = sent_decode["kv_transfer_params"]
    assert transfer["x"] == 1
    assert (
        transfer["kvtier_transfer_id"] == sent_prefill["kv_transfer_params"]["kvtier_transfer_id"]
    )


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (post("/v1/completions", b"{}", "-1"), 400),
        (post("/v1/completions", b"{}", "abc"), 400),
        (post("/v1/completions", b"{}", "1.5"), 400),
        (post("/v1/completions", b"{}", ""), 411),
        (post("/v1/completions", b"", str(pd_proxy.MAX_BODY + 1)), 413),
        (post("/v1/completions", b"[1, 2]"), 400),
        (post("/v1/completions", b"not json"), 400),
        (post("/v1/completions", b'{"prompt": "x", "kv_transfer_params": [1]}'), 400),
        (post("/v1/completions", b'{"prompt": "x", "kv_transfer_params": "id"}'), 400),
    ],
    ids=[
        "len-neg",
        "len-text",
        "len-float",
        "len-missing",
        "too-big",
        "array",
        "not-json",
        "params-list",
        "params-str",
    ],
)
def test_bad_requests_get_a_json_error_before_any_work(
    proxy: int, upstreams: tuple[Upstream, Upstream], raw: bytes, status: int
) -> None:
    got, body = exchange(proxy, raw)
    assert got == status and body["error"]["code"] == status
    assert upstreams[0].bodies == [] and upstreams[1].bodies == []  # no prefill, no decode


def test_a_half_sent_request_is_answered_408_in_bounded_time(
    upstreams: tuple[Upstream, Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pd_proxy, "REQUEST_TIMEOUT_S", 1.0)
    server = pd_proxy.make_server(upstreams[0].url, upstreams[1].url)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=20) as sock:
            sock.sendall(post("/v1/completions", b'{"pro', "100"))
            started = time.monotonic()
            data = b""
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                for _ in range(100):  # a byte every 0.2 s: never done, never idle
                    time.sleep(0.2)
                    sock.sendall(b" ")
            data = sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 408"), data
            assert time.monotonic() - started < 10  # generous: the machine is loaded
        assert upstreams[0].bodies == []
    finally:
        server.shutdown()
        server.server_close()


def test_connections_beyond_the_bound_get_503(
    upstreams: tuple[Upstream, Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pd_proxy, "MAX_CONNECTIONS", 3)
    server = pd_proxy.make_server(upstreams[0].url, upstreams[1].url)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    held = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(3)]
    try:
        time.sleep(0.5)  # let the server take them
        status, body = exchange(server.server_port, post("/v1/completions", b"{}"))
        assert status == 503 and "too many" in body["error"]["message"]
    finally:
        for sock in held:
            sock.close()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "-1"], "--timeout"),
        (["--port", "70000"], "--port"),
        (["--decoder", "127.0.0.1:8200"], "--decoder"),
        (["--decoder", "ftp://h:1"], "--decoder"),
        (["--prefiller", "http://h:99999"], "--prefiller"),
    ],
)
def test_arguments_are_validated(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--prefiller": "http://127.0.0.1:1", "--decoder": "http://127.0.0.1:2"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["pd-proxy", *[x for kv in base.items() for x in kv]]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
