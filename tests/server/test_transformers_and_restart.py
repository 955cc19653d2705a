"""The transformers connector, unchanged, on a server client: outputs equal recompute, hits
from a second process, misses while the server is dead, hits again (disk) after a restart;
the server's life as a service (SIGTERM drain, systemd readiness)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from kvtier.integrations.hf_kv import layout_from_model
from kvtier.integrations.transformers import HFConnector
from kvtier.server.client import ServerClient
from tests.integrations.oracle import CASE_IDS, CASES, CHUNK, reference, tiny_model, tokens
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    client_config,
    idle_server_state,
    remove_tempdir,
    short_tempdir,
    wait_until,
)

NEW = 8


def model_client(url: str, model: Any, **overrides: object) -> ServerClient:
    config = client_config(chunk_size=CHUNK, **overrides)
    client = ServerClient(
        url, layout_from_model(model), model_name="oracle", config=config, max_backoff=0.2
    )
    return client.open()


def check(conn: HFConnector, prompt: torch.Tensor, tol: float) -> Any:
    want_tokens, want_logits = reference(conn.model, prompt, NEW)
    eos = conn.model.generation_config.eos_token_id  # generate() stops there too
    got = conn.generate(prompt, NEW, eos_token_id=eos if isinstance(eos, int) else None)
    assert got.tokens == want_tokens
    pre = conn.prefill(prompt)
    torch.testing.assert_close(pre.logits.float().cpu(), want_logits.float(), atol=tol, rtol=0)
    return got


@pytest.mark.parametrize(
    ("family", "dtype", "tol"), CASES[:1] + CASES[4:5], ids=CASE_IDS[:1] + CASE_IDS[4:5]
)
def test_connector_on_a_server_client_matches_recompute(
    server: ServerProcess, family: str, dtype: torch.dtype, tol: float
) -> None:
    model = tiny_model(family, dtype)
    with model_client(server.url, model) as client, model_client(server.url, model) as other:
        conn = HFConnector(client, model)  # type: ignore[arg-type]  # the Engine surface
        base = tokens(5 * CHUNK + 7, seed=61)
        cold = check(conn, base, tol)
        assert cold.hit_tokens == 0 and cold.stored_chunks == 5
        branch = torch.cat([base[: 3 * CHUNK + 9], tokens(40, seed=62)])
        assert check(conn, branch, tol).reused_tokens == 3 * CHUNK
        # another connection (another engine process, as far as the server knows) hits too
        other_conn = HFConnector(other, model)  # type: ignore[arg-type]
        longer = torch.cat([base, tokens(30, seed=63)])
        assert check(other_conn, longer, tol).reused_tokens == 5 * CHUNK
        assert idle_server_state(client) == IDLE


def test_server_killed_then_restarted_with_a_warm_disk_tier(tmp_path: Any) -> None:
    directory = short_tempdir()
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": "64MiB"}
    model = tiny_model("llama", torch.float32)
    proc = ServerProcess(directory, max_local_cpu_size="4MiB", **disk).start()
    try:
        with model_client(proc.url, model) as client:
            conn = HFConnector(client, model)  # type: ignore[arg-type]
            prompt = tokens(6 * CHUNK + 3, seed=71)
            assert check(conn, prompt, 1e-5).stored_chunks == 6
            assert client.flush(10)  # on disk before the crash
            assert check(conn, prompt, 1e-5).reused_tokens == 6 * CHUNK

            proc.kill()  # SIGKILL: no drain
            dead = check(conn, prompt, 1e-5)  # outputs unchanged, all recomputed
            assert dead.hit_tokens == 0 and dead.stored_chunks == 0
            assert not client.connected and client.stats()["unserved"] > 0

            proc.start()  # a new server on the same socket path and disk directory
            wait_until(lambda: client.lookup(prompt, "probe").tokens > 0, what="reconnect")
            client.end_request("probe")
            warm = check(conn, prompt, 1e-5)
            assert warm.reused_tokens == 6 * CHUNK
            stats = client.stats()
            assert stats["connects"] == 2
            assert stats["hit_tokens_by_tier"]["disk"] >= 6 * CHUNK  # served from disk
            assert idle_server_state(client) == IDLE
    finally:
        proc.stop()
        remove_tempdir(directory)


def test_sigterm_drains_and_exits_cleanly(tmp_path: Any) -> None:
    directory = short_tempdir()
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": "64MiB"}
    model = tiny_model("llama", torch.float32)
    proc = ServerProcess(directory, max_local_cpu_size="4MiB", **disk).start()
    try:
        with model_client(proc.url, model) as client:
            conn = HFConnector(client, model)  # type: ignore[arg-type]
            prompt = tokens(4 * CHUNK, seed=81)
            assert conn.generate(prompt, 2).stored_chunks == 4  # no flush: the drain must
            assert client.lookup(prompt, "open-at-exit").tokens == 4 * CHUNK  # held at SIGTERM
            assert proc.terminate() == 0
            log = proc.log()
            assert "SIGTERM: draining" in log and "kvtier server stopped" in log
            assert "Traceback" not in log
            proc.start()
            wait_until(lambda: client.lookup(prompt, "again").tokens > 0, what="reconnect")
            assert client.retrieve(prompt, "again").shape[2] == 4 * CHUNK
            assert client.stats()["hit_tokens_by_tier"].get("disk") == 4 * CHUNK
            client.end_request("again")
    finally:
        proc.stop()
        remove_tempdir(directory)


def test_systemd_hears_ready_and_stopping() -> None:
    directory = short_tempdir()
    notify_path = f"{directory}/notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(60)
    proc = ServerProcess(directory, max_local_cpu_size="1MiB")
    proc.env["NOTIFY_SOCKET"] = notify_path
    try:
        proc.start()
        assert listener.recv(64) == b"READY=1"
        assert proc.terminate() == 0
        assert listener.recv(64) == b"STOPPING=1"
    finally:
        listener.close()
        proc.stop()
        remove_tempdir(directory)
