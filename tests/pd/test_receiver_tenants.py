"""Per-tenant shares of the receive buffer over real sockets (kvtier.pd.tenant_shares): the
tenant travels in the AllocRequest, one tenant's flood stays within its share while another
tenant's transfer goes through, and a sender that dies mid-transfer leaves no charge."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.errors import TransferError, TransferTimeout
from kvtier.observability.metrics import engine_registry
from kvtier.pd.protocol import AllocReply, AllocRequest, Hello, recv_message, send_message
from kvtier.pd.puller import Puller
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender, chunks_from_kv
from kvtier.request_salt import tenant_of
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT
from tests.pd.pd_helpers import (
    PAGE_BYTES,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    pd_connect,
    pd_tier,
    sender,
)
from tests.pd.test_pull import hold, keys_of, source

PAGES = 8
FLOOD_CHUNKS = 2  # per flood request: a 50 % share (4 pages) takes two of them


def tokens_for(tenant: str, i: int, chunks: int = FLOOD_CHUNKS) -> list[int]:
    """Request i of ``tenant``: distinct prompts from counters (no two share a chunk)."""
    base = (sum(tenant.encode()) * 1000 + i) * 97
    return [(base + t) % 32000 for t in range(chunks * SMALL_CHUNK)]


def send_as(tx: PDSender, tenant: str, rid: str, tokens: list[int]) -> None:
    spans = keychain().keys(tokens, include_partial=True)
    tx.send(rid, chunks_from_kv(spans, fake_prefill(tokens)), tenant=tenant)


@pytest.fixture
def quota_decoder(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, PDReceiver]]:
    engine, receiver = decoder("tcp", PAGES, timeout=0.5, **request.param)
    yield engine, receiver
    receiver.close()
    engine.close()


# The victim is named: the salts under "*" share one share (mallory's flood fills it), and
# a tenant with a row of its own keeps its share whatever they send (docs/tenants.md).
WITH_SHARES = {"tenant_quotas": {"victim": "50%", "*": "50%"}}


@pytest.mark.parametrize("quota_decoder", [WITH_SHARES, {}], indirect=True, ids=["shares", "none"])
def test_one_tenants_flood_does_not_block_another_tenants_transfer(
    quota_decoder: tuple[Engine, PDReceiver],
) -> None:
    engine, receiver = quota_decoder
    shares = bool(engine.config.tenant_quotas)
    with sender("tcp", receiver.port, 0.5) as flood, sender("tcp", receiver.port, 0.5) as other:
        outcomes = []
        for i in range(6):  # the decoder ends none of them yet: their pages stay held
            try:
                send_as(flood, "mallory", f"f{i}", tokens_for("mallory", i))
                outcomes.append("ok")
            except TransferTimeout as exc:
                outcomes.append("tenant" if "tenant 'mallory'" in str(exc) else "full")
        victim = tokens_for("victim", 0)
        if shares:  # mallory stops at her share; the victim's transfer goes straight in
            assert outcomes == ["ok", "ok"] + ["tenant"] * 4
            send_as(other, "victim", "v0", victim)
        else:  # the control: without shares the flood takes the buffer and the victim waits
            assert outcomes == ["ok"] * 4 + ["full"] * 2
            with pytest.raises(TransferTimeout):
                send_as(other, "victim", "v0", victim)
    tier = pd_tier(engine)
    if shares:
        outcome = receiver.wait_outcome("v0", 5.0)
        assert outcome is not None and outcome.ok
        with engine.request("v0"):  # every byte as sent: the tenant changed nothing in it
            assert torch.equal(engine.retrieve(victim, "v0"), fake_prefill(victim))
        report = engine.stats()["tiers"]["pd"]["tenants"]
        assert report["mallory"]["held_bytes"] == 4 * PAGE_BYTES
        assert report["mallory"]["limit_bytes"] == 4 * PAGE_BYTES
        assert report["mallory"]["share_refusals"] == 4
        value = engine_registry(engine).get_sample_value  # the same rows on /metrics
        labels = {"tier": "pd", "tenant": "mallory"}
        assert value("kvtier_tenant_held_bytes", labels) == 4 * PAGE_BYTES
        assert value("kvtier_tenant_limit_bytes", labels) == 4 * PAGE_BYTES
    else:
        assert "tenants" not in engine.stats()["tiers"]["pd"]
    for i in range(6):
        engine.end_request(f"f{i}")
    engine.end_request("v0")
    assert_all_free(engine)
    assert all(tier.shares.held(t) == 0 for t in ("mallory", "victim"))


@pytest.mark.parametrize("quota_decoder", [WITH_SHARES], indirect=True, ids=["shares"])
def test_a_flood_from_many_connections_at_once_stays_within_its_share(
    quota_decoder: tuple[Engine, PDReceiver],
) -> None:
    """Three connections of one tenant send at once while another tenant sends: the flood
    is held to its share whatever the interleaving, the other tenant's transfers all land."""
    engine, receiver = quota_decoder
    tier = pd_tier(engine)
    peak = [0]
    stop = threading.Event()

    def flood(n: int) -> None:
        with sender("tcp", receiver.port, 0.2) as tx:
            for i in range(5):
                with contextlib.suppress(TransferError):  # over its share: refused
                    send_as(tx, "mallory", f"f{n}-{i}", tokens_for("mallory", n * 10 + i))

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tier.shares.held("mallory"))
            time.sleep(0.001)

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(3)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for thread in threads:
        thread.start()
    with sender("tcp", receiver.port, 2.0) as tx:
        for i in range(3):  # within the victim's own share: 3 x 1 chunk
            send_as(tx, "victim", f"v{i}", tokens_for("victim", i, chunks=1))
    for thread in threads:
        thread.join(30)
    stop.set()
    watcher.join()
    assert 0 < peak[0] <= PAGES // 2
    for i in range(3):
        outcome = receiver.wait_outcome(f"v{i}", 5.0)
        assert outcome is not None and outcome.ok
    for rid in [f"f{n}-{i}" for n in range(3) for i in range(5)] + ["v0", "v1", "v2"]:
        engine.end_request(rid)
    assert_all_free(engine)


@pytest.mark.parametrize("quota_decoder", [WITH_SHARES], indirect=True, ids=["shares"])
def test_a_sender_that_dies_mid_transfer_leaves_no_charge(
    quota_decoder: tuple[Engine, PDReceiver],
) -> None:
    engine, receiver = quota_decoder
    tier = pd_tier(engine)
    chain = keychain()
    spans = chain.keys(tokens_for("mallory", 0), include_partial=True)
    sock = pd_connect(receiver.port, timeout=None)
    try:
        hello = Hello(chain.fingerprint.hex(), PAGE_BYTES, SMALL_LAYOUT.token_bytes(), "tcp")
        send_message(sock, hello)
        recv_message(sock)
        keys = [s.key for s in spans]
        send_message(sock, AllocRequest("doomed", keys, [s.num_tokens for s in spans], "mallory"))
        assert isinstance(recv_message(sock), AllocReply)
        assert tier.shares.held("mallory") == len(spans)
    finally:
        sock.close()  # dies before sending a chunk
    outcome = receiver.wait_outcome("doomed", 5.0)
    assert outcome is not None and not outcome.ok
    assert tier.shares.held("mallory") == 0  # given back once, with the reservation
    engine.end_request("doomed")  # the lease's own release is then a no-op
    assert tier.shares.held("mallory") == 0
    assert_all_free(engine)


@pytest.mark.parametrize("quota_decoder", [WITH_SHARES], indirect=True, ids=["shares"])
def test_a_tenant_name_longer_than_a_cache_salt_is_a_protocol_error(
    quota_decoder: tuple[Engine, PDReceiver],
) -> None:
    engine, receiver = quota_decoder
    chain = keychain()
    spans = chain.keys(tokens_for("x", 0), include_partial=True)
    with pd_connect(receiver.port, timeout=None) as sock:
        hello = Hello(chain.fingerprint.hex(), PAGE_BYTES, SMALL_LAYOUT.token_bytes(), "tcp")
        send_message(sock, hello)
        recv_message(sock)
        request = AllocRequest(
            "r", [s.key for s in spans], [s.num_tokens for s in spans], "t" * 1025
        )
        send_message(sock, request)
        assert recv_message(sock) is None  # closed on the protocol error
    assert receiver.protocol_errors == 1
    assert_all_free(engine)


def test_the_tenant_is_the_requests_cache_salt() -> None:
    assert tenant_of("alice") == "alice" and (tenant_of(None) or "") == ""


def test_a_pulled_transfer_is_charged_to_the_decoders_own_tenant() -> None:
    """Pulled (xPyD): the prefiller names no tenant; the decoder charges its own request's."""
    src = source()
    engine, receiver = decoder("tcp", PAGES, timeout=0.5, tenant_quotas={"*": "25%"})
    puller = Puller(receiver)
    try:
        host, port = src.address
        small, big = tokens_for("alice", 0), tokens_for("alice", 1, chunks=3)
        hold(src, "t1", small, salt="alice")
        hold(src, "t2", big, salt="alice")
        outcome = puller.pull(host, port, "t1", keys_of(small, salt="alice"), "alice")
        assert outcome.ok, outcome.reason
        assert pd_tier(engine).shares.held("alice") == FLOOD_CHUNKS
        refused = puller.pull(host, port, "t2", keys_of(big, salt="alice"), "alice")
        assert not refused.ok and "tenant 'alice' needs 3 pages" in refused.reason  # share: 2
        engine.end_request("t1")
        assert pd_tier(engine).shares.held("alice") == 0
        assert_all_free(engine)
    finally:
        puller.close()
        receiver.close()
        engine.close()
        src.close()
