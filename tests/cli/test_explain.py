"""``kvtier explain`` reaches a running engine's admin API: a request's found and miss runs, the
recent requests, a clear "not found", and a hint when no admin API answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvtier import Service
from kvtier.cli.main import main
from tests.conftest import make_kv, make_tokens

TOKEN = "explain-t0ken"


@pytest.fixture
def admin(service_factory: Callable[..., Service]) -> Service:
    service = service_factory(
        cpu_chunks=8,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
        admin_token=TOKEN,
    )
    tokens = make_tokens(32)
    service.engine.store(tokens, make_kv(32))
    service.engine.lookup(tokens + make_tokens(16, seed=4), "req-7")
    service.engine.end_request("req-7")
    return service


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_prints_a_requests_hit_and_miss_runs(
    admin: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    assert admin.admin_url is not None
    code, out, _ = _explain(capsys, "req-7", "--admin", admin.admin_url, "--token", TOKEN)
    assert code == 0
    record = admin.engine.observer.explain.get("req-7")
    assert record is not None
    assert record["found_tokens"] == 32 and record["prompt_tokens"] == 48
    assert record["loaded_tokens"] == 0 and record["unused_tokens"] == 32  # never retrieved
    assert "request req-7: 32 of 48 prompt tokens found, 0 loaded, 32 unused" in out
    assert "chunks 0-1 (tokens 0-32): cpu" in out
    assert "chunk 2 (tokens 32-48): miss: not stored" in out
    code, out, _ = _explain(capsys, "req-7", "--admin", admin.admin_url, "--token", TOKEN, "--json")
    assert code == 0 and json.loads(out) == record


def test_explain_without_an_id_lists_recent_requests(
    admin: Service, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert admin.admin_url is not None
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", TOKEN)  # read when the parser is built
    code, out, _ = _explain(capsys, "--admin", admin.admin_url)
    assert code == 0 and "req-7: 32 of 48 prompt tokens found, 0 loaded, 32 unused" in out


def test_explain_says_what_went_wrong(admin: Service, capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.admin_url is not None
    code, _, err = _explain(capsys, "nobody", "--admin", admin.admin_url, "--token", TOKEN)
    assert code == 1 and "HTTP 404" in err and "no recent lookup for request 'nobody'" in err
    code, _, err = _explain(capsys, "req-7", "--admin", admin.admin_url)  # no token
    assert code == 1 and "HTTP 401" in err
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    code, _, err = _explain(capsys, "req-7", "--admin", f"http://127.0.0.1:{port}")
    assert code == 1 and "internal_api_server_enabled: true" in err


def test_explain_says_a_miss_came_from_the_tenants_quota(
    service_factory: Callable[..., Service], capsys: pytest.CaptureFixture[str]
) -> None:
    service = service_factory(
        cpu_chunks=8,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
        admin_token=TOKEN,
        tenant_quotas={"t": "50%"},
    )
    engine, first = service.engine, make_tokens(64, seed=1)
    engine.store(first, make_kv(64, seed=1), cache_salt="t")
    engine.store(make_tokens(64, seed=2), make_kv(64, seed=2), cache_salt="t")  # t's own 4
    engine.store(make_tokens(32, seed=3), make_kv(32, seed=3), cache_salt="u")  # no quota
    engine.lookup(first, "req-q", cache_salt="t")
    engine.end_request("req-q")
    assert service.admin_url is not None
    code, out, _ = _explain(capsys, "req-q", "--admin", service.admin_url, "--token", TOKEN)
    assert code == 0
    assert "chunks 0-3 (tokens 0-64): miss: quota" in out
    assert "tenant 't' was over its quota" in out


def test_a_reader_that_stops_early_ends_it_quietly(admin: Service) -> None:
    """``kvtier explain ... | head``: the reader is gone before the first line; no
    BrokenPipeError traceback (issue 58, item 10)."""
    assert admin.admin_url is not None
    read, write = os.pipe()
    os.close(read)  # head that has read its lines and exited
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "explain", "req-7"]
            + ["--admin", admin.admin_url, "--token", TOKEN],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 1
