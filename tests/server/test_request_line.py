"""With a kvtier server, the engine process (a vLLM worker) keeps its per-request line: the
server answers EndRequest with what its engine recorded of the request, and the client logs
it on ``kvtier.requests`` under the client's own request id (issue 50, item 7)."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import make_kv, make_tokens
from tests.server.server_helpers import InProcess, open_client, remove_tempdir, short_tempdir


def test_the_client_logs_the_request_line_its_server_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = short_tempdir()
    server = InProcess(directory)
    try:
        with open_client(server.url) as client:
            tokens = make_tokens(64, 5)
            client.store(tokens, make_kv(64, 5))
            with caplog.at_level(logging.INFO, logger="kvtier.requests"):
                assert client.lookup(tokens + [7], "vllm-req-1").tokens == 64
                assert client.retrieve(tokens + [7], "vllm-req-1").shape[2] == 64
                assert client.end_request("vllm-req-1") is True
                assert client.end_request("vllm-req-1") is False  # again: nothing, no line
                client.end_request("never-looked-up")  # nothing noted: no line
    finally:
        server.close()
        remove_tempdir(directory)
    # The server runs in this process too: its own line comes from its engine's observer
    # (under its session's id); the client's from the client module.
    from_client = [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvtier.requests" and r.pathname.endswith("server/client.py")
    ]
    assert from_client == [
        "request vllm-req-1: 65 prompt tokens, loaded 64 tokens from kvtier (cpu 64)"
    ]
