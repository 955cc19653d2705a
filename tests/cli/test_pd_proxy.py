"""``kvtier pd-proxy`` runs vllm-router in PD mode; the hand-off it carries between a
prefiller and a decoder is vLLM's standard ``kv_transfer_params`` one, which kvtier's
connector answers. The prefiller and decoder here are small real HTTP servers that record what
reaches them (the same with vLLM itself: tests/integrations/vllm/test_pd_router.py)."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.router import RouterProcess

from kvtier.cli.main import build_parser, main
from kvtier.cli.pd_proxy import router_command
from tests.redis_servers import free_port

ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "kvtier_transfer_id": "t-1"}


class Upstream:
    """A fake vLLM: health, models, and a JSON completion for every POST (the prefiller's
    carries ``ANSWER`` as its kv_transfer_params), recording the bodies."""

    def __init__(self, name: str) -> None:
        self.bodies: list[dict[str, Any]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                if not self.path.endswith("/render"):  # the router's tokenization probes
                    upstream.bodies.append(body)
                answer: dict[str, Any] = {"choices": [{"index": 0, "text": name}]}
                if name == "prefiller":
                    answer["kv_transfer_params"] = ANSWER
                self._send(answer)

            def _send(self, answer: dict[str, Any]) -> None:
                data = json.dumps(answer).encode()
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
    prefiller, decoder = Upstream("prefiller"), Upstream("decoder")
    yield prefiller, decoder
    prefiller.close()
    decoder.close()


def test_the_router_hands_the_prefillers_answer_to_the_decoder(
    upstreams: tuple[Upstream, Upstream], tmp_path: Path
) -> None:
    """What kvtier's connector relies on, through the real router the command execs."""
    prefiller, decoder = upstreams
    port = free_port()
    command = [sys.executable, "-m", "kvtier.cli.main", "pd-proxy"]
    command += ["--prefiller", prefiller.url, "--decoder", decoder.url, "--port", str(port)]
    command += ["--", "--prometheus-port", str(free_port())]
    src = str(Path(__file__).resolve().parents[2] / "src")
    router = RouterProcess(command, port, tmp_path / "router.log", PYTHONPATH=src)
    try:
        router.wait_ready()
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0}
        request = urllib.request.Request(
            f"{router.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
    finally:
        router.stop()
    assert answer["choices"][0]["text"] == "decoder"
    (sent_prefill,), (sent_decode,) = prefiller.bodies, decoder.bodies
    assert sent_prefill["max_tokens"] == 1 and sent_prefill["stream"] is False
    assert sent_prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert sent_decode["max_tokens"] == 5
    assert sent_decode["kv_transfer_params"] == ANSWER  # as the prefiller answered it
    assert "exec " in router.log.read_text()


def test_the_router_command_line() -> None:
    args = build_parser().parse_args(
        ["pd-proxy", "--prefiller", "http://p:1/", "--prefiller", "http://q:2"]
        + ["--decoder", "http://d:3", "--timeout", "30", "--", "--policy", "round_robin"]
    )
    command = router_command(args)
    assert Path(command[0]).name == "vllm-router"
    assert command[1:] == [
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://p:1",
        "--prefill",
        "http://q:2",
        "--decode",
        "http://d:3",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--request-timeout-secs",
        "30",
        "--worker-startup-check-interval",
        "1",
        "--policy",
        "round_robin",
    ]


def test_a_missing_router_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    code = main(["pd-proxy", "--prefiller", "http://127.0.0.1:1", "--decoder", "http://h:2"])
    assert code == 2
    assert "vllm-router is not installed" in capsys.readouterr().err


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
