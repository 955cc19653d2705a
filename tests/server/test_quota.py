"""Per-salt quotas: the engines of one engine-wide salt together hold at most server_salt_quota
bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import ServerProcess, open_client, remove_tempdir, short_tempdir

CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


@pytest.fixture
def quota_server() -> Iterator[ServerProcess]:
    directory = short_tempdir()
    proc = ServerProcess(
        directory,
        max_local_cpu_size=f"{8 * CHUNK_BYTES}B",
        server_salt_quota=f"{10 * CHUNK_BYTES}B",
        server_client_pin_share=1.0,  # the quota under test, not the per-client share
    ).start()
    yield proc
    proc.stop()
    remove_tempdir(directory)


def test_a_salt_holds_at_most_its_quota(quota_server: ServerProcess) -> None:
    url = quota_server.url
    first = open_client(url, model_name="a", cache_salt="t1")
    second = open_client(url, model_name="b", cache_salt="t1")  # what is left: 2 chunks
    third = open_client(url, model_name="c", cache_salt="t1")  # nothing left: refused
    other = open_client(url, model_name="a", cache_salt="t2")  # another salt: its own quota
    try:
        assert first.stats()["allocator"]["pages_total"] == 8
        assert second.stats()["allocator"]["pages_total"] == 2
        assert not third.connected
        assert third.lookup(make_tokens(32), "r").tokens == 0  # a miss, never an error
        assert "server_salt_quota" in quota_server.log()
        assert other.stats()["allocator"]["pages_total"] == 8
        # the quota is enforced by capacity: a store beyond it evicts or drops, never grows
        tokens = make_tokens(4 * SMALL_CHUNK, 9)
        assert second.store(tokens, make_kv(4 * SMALL_CHUNK, 9)) == 2
        assert second.stats()["allocator"]["pages_used"] == 2
    finally:
        for client in (first, second, third, other):
            client.close()


@pytest.fixture
def salted_server() -> Iterator[ServerProcess]:
    directory = short_tempdir()
    proc = ServerProcess(
        directory,
        max_local_cpu_size=f"{16 * CHUNK_BYTES}B",
        tenant_quotas={"flood": "25%", "*": "50%"},
        server_client_pin_share=1.0,
    ).start()
    yield proc
    proc.stop()
    remove_tempdir(directory)


def test_tenant_quotas_hold_per_request_salt_on_a_shared_model(
    salted_server: ServerProcess,
) -> None:
    """tenant_quotas (docs/tenants.md) on a server: one model, its requests' cache_salts the
    tenants, every store through the shared pages; a flood stays in its 25 %."""
    flooder = open_client(salted_server.url)
    quiet = open_client(salted_server.url)
    try:
        prompt = 4 * SMALL_CHUNK
        kept = make_tokens(prompt, 1)
        assert quiet.store(kept, make_kv(prompt, 1), cache_salt="quiet") == 4
        for seed in range(10, 22):  # 48 chunks into a tier of 16
            flooder.store(make_tokens(prompt, seed), make_kv(prompt, seed), cache_salt="flood")
        tenants = quiet.stats()["tiers"]["cpu"]["tenants"]
        assert tenants["flood"]["held_bytes"] == 4 * CHUNK_BYTES
        assert tenants["flood"]["quota_evictions"] == 44
        assert tenants["quiet"]["held_bytes"] == 4 * CHUNK_BYTES
        assert quiet.lookup(kept, "r", cache_salt="quiet").tokens == prompt
        quiet.end_request("r")
        assert quiet.check_invariants() == []
    finally:
        flooder.close()
        quiet.close()
