"""The redis tier against a real redis-server (started once for this module)."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvtier import Engine
from kvtier.config.remote_url import parse_remote_url
from kvtier.errors import ConfigError, KVTierError
from kvtier.fingerprint import Fingerprint
from kvtier.storage import record_reads, records
from kvtier.storage.base import PutJob, PutOutcome
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tier import RedisTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisServer, free_port, make_tls_files
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    Outcomes,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)

FINGERPRINT = Fingerprint("contract-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
FINGERPRINT_SMALL = Fingerprint("m", SMALL_LAYOUT, CONTRACT_CHUNK)


def open_tier(url: str, fingerprint: Fingerprint = FINGERPRINT, **options: object) -> RedisTier:
    opts = RedisOptions(**{"timeout_s": 2.0, **options})  # type: ignore[arg-type]
    tier = RedisTier(parse_remote_url(url), fingerprint.layout, fingerprint, opts)
    tier.open()
    return tier


class TestRedisTierContract(TierContract):
    @pytest.fixture
    def tier(self, server: RedisServer) -> Iterator[RedisTier]:
        tier = open_tier(server.url)
        yield tier
        tier.clear()
        tier.close()


@pytest.fixture
def tier(server: RedisServer) -> Iterator[RedisTier]:
    tier = open_tier(server.url)
    yield tier
    tier.clear()
    tier.close()


def test_value_is_a_checksummed_record_under_a_fingerprinted_name(
    tier: RedisTier, server: RedisServer
) -> None:
    key, data = random_key(), payload(CONTRACT_CHUNK, 7)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    name = f"kvtier:{FINGERPRINT.hex()}:{key.hex()}".encode()
    assert tier.store.name_of(key) == name
    with server.client() as raw:
        value = raw.get(name)
    assert value is not None
    assert len(value) == records.header_size() + data.numel()
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert record_reads.decode_record_into(value, FINGERPRINT, key, out) == CONTRACT_CHUNK
    assert torch.equal(out[: data.numel()], data)


def test_two_models_never_share_a_chunk(server: RedisServer) -> None:
    other_fp = Fingerprint("another-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
    first, second = open_tier(server.url), open_tier(server.url, other_fp)
    try:
        key = random_key()
        put_and_wait(first, key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
        assert first.contains([key]) == [True]
        assert second.contains([key]) == [False]
        assert second.clear() == 0  # clear touches only its own fingerprint's names
        assert first.contains([key]) == [True]
    finally:
        first.clear()
        first.close()
        second.close()


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_checksum_hashed_while_reading_covers_every_payload_byte(
    tier: RedisTier, server: RedisServer, where: str
) -> None:
    """The payload is hashed piece by piece as it lands (the first bytes arrive in the same
    read as the header, the last in the final recv): a flip at either end is still a miss."""
    key, data = random_key(), payload(CONTRACT_CHUNK, 9)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    offset = records.header_size() + (0 if where == "first" else data.numel() - 1)
    with server.client() as raw:
        raw.setrange(tier.store.name_of(key), offset, b"\x5a")
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert tier.get_into(key, out) is None
    assert tier.counters.corrupt == 1


def test_corrupt_record_is_a_miss_deleted_and_counted(tier: RedisTier, server: RedisServer) -> None:
    key, data = random_key(), payload(CONTRACT_CHUNK, 8)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    name = tier.store.name_of(key)
    with server.client() as raw:
        raw.setrange(name, records.header_size() + 100, b"\xff\x00\xff")  # flip payload bytes
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) is None
        assert raw.exists(name) == 0
    assert tier.counters.corrupt == 1
    # A value too short to hold a header, and one with a garbage header: same outcome.
    for junk in (b"short", b"x" * (records.header_size() + data.numel())):
        with server.client() as raw:
            raw.set(name, junk)
        assert tier.get_into(key, out) is None
        assert tier.contains([key]) == [False]
    assert tier.counters.corrupt == 3
    # The connection pool stays usable after refusing those replies.
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    assert tier.get_into(key, out) == CONTRACT_CHUNK


def test_ttl_expires_chunks(server: RedisServer) -> None:
    tier = open_tier(server.url, ttl_s=30.0)
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
        with server.client() as raw:
            ttl_ms = raw.pttl(tier.store.name_of(key))
        assert 0 < ttl_ms <= 30_000
    finally:
        tier.clear()
        tier.close()


def test_bad_ttl_names_its_key(server: RedisServer) -> None:
    for bad in (-1, 0, "soon", 1e12, 0.0001):
        config = small_config(remote_url=server.url, extra_config={"remote_ttl_secs": bad})
        with pytest.raises(ConfigError, match=r"extra_config\.remote_ttl_secs"):
            RedisOptions.from_config(config)
    config = small_config(remote_url=server.url, extra_config={"remote_inflight_bytes": "lots"})
    with pytest.raises(ConfigError, match=r"extra_config\.remote_inflight_bytes"):
        RedisOptions.from_config(config)


def test_puts_over_the_inflight_bound_are_dropped_at_once(server: RedisServer) -> None:
    # One put fits (the first is always accepted); while it is queued, the next is dropped.
    tier = open_tier(server.url, inflight_bytes=1, put_threads=1)
    try:
        done = Outcomes()
        keys = [random_key() for _ in range(20)]
        for i, key in enumerate(keys):
            tier.put(PutJob(key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK, "", done))
        results = done.wait(len(keys))
        assert tier.flush(10.0)
        outcomes = [r.outcome for r in results]
        assert PutOutcome.DROPPED in outcomes and PutOutcome.STORED in outcomes
        assert tier.counters.dropped == outcomes.count(PutOutcome.DROPPED)
        assert len(results) == len(keys)
    finally:
        tier.clear()
        tier.close()


def test_a_page_view_is_stored_whole(tier: RedisTier, server: RedisServer) -> None:
    # A multi-dimensional memoryview was once stored as 2 bytes; every byte must be sent.
    key, data = random_key(), payload(CONTRACT_CHUNK, 11)
    pages = torch.zeros(3 * PAGE_BYTES, dtype=torch.uint8)
    pages[PAGE_BYTES : PAGE_BYTES + data.numel()] = data
    put_and_wait(tier, key, pages[PAGE_BYTES : PAGE_BYTES + data.numel()], CONTRACT_CHUNK)
    with server.client() as raw:
        assert raw.strlen(tier.store.name_of(key)) == records.header_size() + data.numel()
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert tier.get_into(key, out) == CONTRACT_CHUNK
    assert torch.equal(out, data)


def test_closed_tier_refuses_calls(server: RedisServer) -> None:
    tier = open_tier(server.url)
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(KVTierError):
        tier.contains([random_key()])


# -- engine level ------------------------------------------------------------------------


def _engine(url: str, **overrides: object) -> Engine:
    return Engine(small_config(remote_url=url, **overrides), SMALL_LAYOUT, model_name="m").open()


@pytest.mark.parametrize("local_cpu", [True, False])
def test_remote_hit_is_copied_to_cpu_as_the_tier_roles_say(
    server: RedisServer, local_cpu: bool
) -> None:
    tokens, kv = make_tokens(64, seed=3), make_kv(64, seed=3)
    with _engine(server.url) as writer:
        assert writer.store(tokens, kv) == 4
        assert writer.flush(10.0)
    with _engine(server.url, local_cpu=local_cpu) as reader:
        assert reader.lookup(tokens, "r1").tokens == 64
        got = reader.retrieve(tokens, "r1")
        assert torch.equal(got, kv)
        reader.end_request("r1")
        cpu_entries = reader.stats()["tiers"]["cpu"]["entries"]
        assert cpu_entries == (4 if local_cpu else 0)
        assert reader.stats()["tiers"]["redis"]["hits"] == 4
        assert reader.check_invariants() == [] and reader.leaks() == []
        _clear_redis(reader)


def _clear_redis(engine: Engine) -> None:
    for tier in engine.tiers()[1:]:  # below the CPU tier
        tier.clear()


def _store_in_child(url: str, out_path: str) -> None:
    """Runs in a separate (spawned) process: store a prompt, flush, report what was stored."""
    with _engine(url) as engine:
        tokens, kv = make_tokens(80, seed=5), make_kv(80, seed=5)
        stored = engine.store(tokens, kv)
        ok = engine.flush(20.0)
        Path(out_path).write_text(f"{stored} {ok}")


def test_two_engine_processes_share_a_cache(server: RedisServer, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    report = tmp_path / "child.txt"
    child = ctx.Process(target=_store_in_child, args=(server.url, str(report)))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"storing process failed with {child.exitcode}"
    assert report.read_text() == "5 True"
    tokens, kv = make_tokens(80, seed=5), make_kv(80, seed=5)
    with _engine(server.url) as engine:
        assert engine.lookup(tokens, "r").tokens == 80
        got = engine.retrieve(tokens, "r")
        assert got.numpy().tobytes() == kv.numpy().tobytes()  # bytes identical
        engine.end_request("r")
        assert engine.check_invariants() == [] and engine.leaks() == []
        _clear_redis(engine)


def test_factory_builds_the_tier_from_remote_url(
    server: RedisServer, caplog: pytest.LogCaptureFixture, engine_factory: Callable[..., Engine]
) -> None:
    caplog.set_level(logging.INFO)
    engine = engine_factory(remote_url=server.url.replace("redis://", "valkey://"))
    assert "redis" in engine.stats()["tiers"]


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    srv = RedisServer(extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700"))
    try:
        srv.start()
        tier = open_tier(f"unix://{sock}?db=2")
        try:
            key, data = random_key(), payload(CONTRACT_CHUNK, 12)
            assert put_and_wait(tier, key, data, CONTRACT_CHUNK).outcome is PutOutcome.STORED
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert tier.get_into(key, out) == CONTRACT_CHUNK
            assert torch.equal(out, data)
            with redis.Redis(host="127.0.0.1", port=srv.port, db=2) as raw:
                assert raw.exists(tier.store.name_of(key)) == 1
        finally:
            tier.close()
    finally:
        srv.cleanup()


def test_rediss_url_talks_tls(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    tls_port = free_port()
    args = ("--tls-port", str(tls_port), "--tls-cert-file", str(tls["cert"]))
    args += ("--tls-key-file", str(tls["key"]), "--tls-ca-cert-file", str(tls["ca"]))
    srv = RedisServer(extra_args=(*args, "--tls-auth-clients", "no"))
    try:
        srv.start()
        config = small_config(
            remote_url=f"rediss://127.0.0.1:{tls_port}",
            extra_config={"remote_tls_ca_file": str(tls["ca"])},
        )
        tier = RedisTier.from_config(config, SMALL_LAYOUT, FINGERPRINT_SMALL)
        tier.open()
        try:
            assert tier.store.link.is_up
            key, data = random_key(), payload(CONTRACT_CHUNK, 13)
            assert put_and_wait(tier, key, data, CONTRACT_CHUNK).outcome is PutOutcome.STORED
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert tier.get_into(key, out) == CONTRACT_CHUNK
            assert torch.equal(out, data)
        finally:
            tier.close()
        # Without the CA the server's certificate is refused: the tier stays disabled.
        untrusted = RedisTier.from_config(
            config.with_overrides(extra_config={}), SMALL_LAYOUT, FINGERPRINT_SMALL
        )
        untrusted.open()
        try:
            assert not untrusted.store.link.is_up
        finally:
            untrusted.close()
    finally:
        srv.cleanup()


def test_missing_ca_file_names_its_key() -> None:
    config = small_config(extra_config={"remote_tls_ca_file": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError, match=r"extra_config\.remote_tls_ca_file"):
        RedisOptions.from_config(config)


def test_a_foreign_value_under_a_chunk_name_is_a_miss(tier: RedisTier, server: RedisServer) -> None:
    key = random_key()
    with server.client() as raw:
        raw.hset(tier.store.name_of(key), "field", "value")  # WRONGTYPE for GET
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert tier.get_into(key, out) is None
    assert tier.store.link.is_up  # a refused command is not an outage
    assert tier.counters.misses == 1


def test_lookup_without_scripting_falls_back_to_a_pipeline() -> None:
    srv = RedisServer(extra_args=("--rename-command", "EVAL", ""))  # as some services do
    try:
        srv.start()
        tier = open_tier(srv.url)
        try:
            keys = [random_key() for _ in range(3)]
            put_and_wait(tier, keys[1], payload(CONTRACT_CHUNK, 14), CONTRACT_CHUNK)
            assert tier.contains(keys) == [False, True, False]
            assert not tier.store._use_script  # EVAL was refused; the pipeline answered
            assert tier.contains(keys) == [False, True, False]
        finally:
            tier.close()
    finally:
        srv.cleanup()


def test_32_threads_at_once_all_hit_and_the_tier_stays_up(server: RedisServer) -> None:
    # More engine calls at once than the pool has connections: the extra calls wait for a
    # connection (bounded by blocking_timeout_secs); a busy pool is not an outage.
    threads, prompts = 32, 8
    corpus = [(make_tokens(64, seed=40 + i), make_kv(64, seed=40 + i)) for i in range(prompts)]
    with _engine(server.url) as writer:
        for tokens, kv in corpus:
            assert writer.store(tokens, kv) == 4
            assert writer.flush(20.0)
    reader = _engine(
        server.url, local_cpu=False, use_only_staging_buffer=True, cpu_chunks=4 * threads + 8
    )
    try:
        hits: list[int] = []
        failures: list[str] = []
        start = threading.Barrier(threads)

        def work(worker: int) -> None:
            start.wait()
            for round_ in range(4):
                tokens, kv = corpus[(worker + round_) % prompts]
                request = f"w{worker}-{round_}"
                try:
                    hits.append(reader.lookup(tokens, request).tokens)
                    if not torch.equal(reader.retrieve(tokens, request), kv):
                        failures.append(f"{request}: wrong KV")
                except Exception as exc:
                    failures.append(f"{request}: {type(exc).__name__}: {exc}")
                finally:
                    reader.end_request(request)

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(120)
        assert failures == []
        assert hits == [64] * (threads * 4)
        tier = reader.tiers()[1]  # the first below the CPU tier
        assert isinstance(tier, RedisTier)
        assert tier.store.link.outages == 0 and tier.store.link.is_up
        assert reader.check_invariants() == [] and reader.leaks() == []
        _clear_redis(reader)
    finally:
        reader.close()


def test_a_busy_pool_is_a_bounded_miss_never_an_outage(server: RedisServer) -> None:
    tier = open_tier(server.url, timeout_s=0.5, put_threads=1, connections=1)
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 15), CONTRACT_CHUNK)
        gate = tier.store.link.gate
        assert gate.size == 2
        for _ in range(gate.size):  # every connection held by someone else
            assert gate.acquire(0.1, lambda: False)
        start = time.monotonic()
        assert tier.contains([key]) == [False]
        assert 0.4 < time.monotonic() - start < 3.0
        assert tier.store.link.is_up and tier.store.link.outages == 0
        for _ in range(gate.size):
            gate.release()
        assert tier.contains([key]) == [True]
        tier.usage()  # refreshes the counters
        assert tier.counters.busy_timeouts == 1
    finally:
        tier.clear()
        tier.close()
