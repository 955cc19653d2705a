"""The redis tier when the server is down, dies, stalls or comes back.

Each test owns its server (it kills or stops it). ``blocking_timeout_secs`` is 1 s here, so
"within the timeout" is checked with a margin for a 2-core machine shared with other work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.errors import KVTierError
from kvtier.storage.base import PutJob, PutOutcome
from kvtier.storage.redis.tier import RedisTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisClusterServers, RedisServer, free_port, wait_until
from tests.storage.redis.test_redis import open_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    PAGE_BYTES,
    Outcomes,
    payload,
    put_and_wait,
    random_key,
)

TIMEOUT_S = 1.0
SLACK_S = 2.5  # scheduling margin on a busy 2-core machine
# Where a test shows a call answers at once (no wait on the socket), the tier's timeout is
# this, so a call that did wait could not pass the bound ``took < SLACK_S``.
LONG_TIMEOUT_S = 3 * SLACK_S


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    try:
        yield srv.start()
    finally:
        srv.cleanup()


def redis_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("kvtier.storage.redis")
    ]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def exercise_every_public_call(tier: RedisTier) -> list[str]:
    """Call each public method once; return the names of foreign exceptions that escaped."""
    key, out, done = random_key(), torch.zeros(PAGE_BYTES, dtype=torch.uint8), Outcomes()
    calls: dict[str, Callable[[], object]] = {
        "contains": lambda: tier.contains([key, random_key()]),
        "get_into": lambda: tier.get_into(key, out),
        "get_many_into": lambda: tier.get_many_into([(key, out)]),
        "put": lambda: tier.put(PutJob(key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK, "", done)),
        "flush": lambda: tier.flush(TIMEOUT_S + SLACK_S),
        "remove": lambda: tier.remove(key),
        "pin": lambda: tier.pin(key),
        "unpin": lambda: tier.unpin(key),
        "usage": tier.usage,
        "clear": tier.clear,
    }
    escaped = []
    for name, call in calls.items():
        try:
            call()
        except KVTierError:
            pass
        except Exception as exc:
            escaped.append(f"{name}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
    done.wait(1, timeout=TIMEOUT_S + SLACK_S)
    return escaped


def test_server_down_at_open_disables_the_tier_then_it_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    server = RedisServer()  # its port is chosen but nothing listens yet
    tier = open_tier(server.url, timeout_s=TIMEOUT_S)
    try:
        assert not tier.store.link.is_up
        keys = [random_key() for _ in range(8)]
        answer, took = timed(lambda: tier.contains(keys))
        assert answer == [False] * 8 and took < SLACK_S
        result, took = timed(lambda: put_and_wait(tier, keys[0], payload(16, 1), 16))
        assert result.outcome is PutOutcome.DROPPED and took < SLACK_S  # type: ignore[union-attr]
        assert tier.get_into(keys[0], torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
        assert exercise_every_public_call(tier) == []
        assert len(redis_warnings(caplog)) == 1, redis_warnings(caplog)

        server.start()
        assert tier.store.link.wait_up(15.0), "tier did not reconnect by itself"
        assert put_and_wait(tier, keys[0], payload(16, 1), 16).outcome is PutOutcome.STORED
        assert tier.contains(keys[:1]) == [True]
    finally:
        tier.close()
        server.cleanup()


def test_cluster_down_at_open_disables_the_tier() -> None:
    url = f"redis-cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    tier = open_tier(url, timeout_s=TIMEOUT_S)
    try:
        assert not tier.store.link.is_up
        assert tier.contains([random_key()]) == [False]
        assert exercise_every_public_call(tier) == []
    finally:
        tier.close()


def test_killed_server_turns_into_misses_then_recovers(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier(server.url, timeout_s=TIMEOUT_S)
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 2), CONTRACT_CHUNK)
        server.kill()
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        answer, took = timed(lambda: tier.get_into(key, out))
        assert answer is None and took < TIMEOUT_S + SLACK_S
        assert tier.contains([key]) == [False]
        assert exercise_every_public_call(tier) == []
        assert len(redis_warnings(caplog)) == 1, redis_warnings(caplog)
        server.start()  # same port, empty: persistence is off
        assert tier.store.link.wait_up(15.0), "tier did not reconnect by itself"
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 2), CONTRACT_CHUNK)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        assert tier.counters.outages == 1 and tier.usage().entries == 1
    finally:
        tier.close()


def test_stalled_server_costs_at_most_the_timeout(server: RedisServer) -> None:
    tier = open_tier(server.url, timeout_s=LONG_TIMEOUT_S)
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 3), CONTRACT_CHUNK)
        server.pause()
        answer, took = timed(lambda: tier.contains([key]))
        assert answer == [False] and took < LONG_TIMEOUT_S + SLACK_S
        # Now known to be down: everything answers at once, nothing waits on the socket
        # (a wait would take LONG_TIMEOUT_S, more than the slack).
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        answer, took = timed(lambda: tier.get_into(key, out))
        assert answer is None and took < SLACK_S
        result = put_and_wait(tier, random_key(), payload(CONTRACT_CHUNK, 4), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.DROPPED
        assert exercise_every_public_call(tier) == []
        server.resume()
        assert tier.store.link.wait_up(15.0), "tier did not come back after the stall"
        assert tier.get_into(key, out) == CONTRACT_CHUNK
    finally:
        server.resume()
        tier.close()


def test_a_write_to_a_server_that_stalls_mid_run_fails_within_the_timeout(
    server: RedisServer,
) -> None:
    tier = open_tier(server.url, timeout_s=TIMEOUT_S)
    try:
        assert tier.store.link.is_up
        server.pause()
        done = Outcomes()
        start = time.monotonic()
        tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, 5), CONTRACT_CHUNK, "", done))
        (result,) = done.wait(1, timeout=TIMEOUT_S + SLACK_S)
        assert result.outcome is PutOutcome.FAILED
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert tier.flush(0.5) and tier.counters.failed == 1
    finally:
        server.resume()
        tier.close()


def test_engine_survives_a_server_killed_mid_request(server: RedisServer) -> None:
    config = small_config(remote_url=server.url, blocking_timeout_secs=TIMEOUT_S, local_cpu=False)
    tokens, kv = make_tokens(64, seed=9), make_kv(64, seed=9)
    threads_before = {t.name for t in threading.enumerate()}
    with Engine(config, SMALL_LAYOUT, model_name="m") as writer:
        assert writer.store(tokens, kv) == 4
        assert writer.flush(10.0)
    with Engine(
        config.with_overrides(use_only_staging_buffer=True), SMALL_LAYOUT, model_name="m"
    ) as reader:
        assert reader.lookup(tokens, "r1").tokens == 64  # found in redis, pinned in the lease
        server.kill()
        start = time.monotonic()
        out = torch.zeros(SMALL_LAYOUT.kv_shape(64), dtype=SMALL_LAYOUT.dtype)
        loaded = reader.retrieve_into(tokens, "r1", out)
        assert loaded == 0  # every chunk was a miss: the engine recomputes
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        reader.end_request("r1")
        assert reader.lookup(tokens, "r2").tokens == 0  # disabled: a quick miss
        reader.store(tokens, kv)  # writes are dropped, never an error
        reader.end_request("r2")
        assert reader.flush(5.0)
        assert reader.check_invariants() == [] and reader.leaks() == []

        server.start()
        tier = reader.tiers()[1]  # the first below the CPU tier
        assert isinstance(tier, RedisTier)
        assert tier.store.link.wait_up(15.0)
        reader.store(tokens, kv)
        assert reader.flush(10.0)
        assert reader.lookup(tokens, "r3").tokens == 64
        assert torch.equal(reader.retrieve(tokens, "r3"), kv)
        reader.end_request("r3")
        assert reader.check_invariants() == [] and reader.leaks() == []
    # No kvtier thread outlives its engine.
    wait_until(
        lambda: not ({t.name for t in threading.enumerate()} - threads_before),
        10,
        "kvtier threads to exit",
    )


def test_close_with_a_dead_server_does_not_hang(server: RedisServer) -> None:
    tier = open_tier(server.url, timeout_s=TIMEOUT_S)
    done = Outcomes()
    for i in range(4):
        tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK, "", done))
    server.pause()
    _, took = timed(tier.close)
    assert took < 3 * TIMEOUT_S + SLACK_S
    assert len(done.wait(4, timeout=0.1)) == 4  # every put completed, one way or another


def test_cluster_with_all_nodes_killed_turns_into_misses() -> None:
    cluster = RedisClusterServers().start()
    try:
        tier = open_tier(cluster.url, timeout_s=TIMEOUT_S)
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 6), CONTRACT_CHUNK)
        for node in cluster.nodes:
            node.kill()
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        answer, took = timed(lambda: tier.get_into(key, out))
        assert answer is None and took < TIMEOUT_S + SLACK_S
        assert exercise_every_public_call(tier) == []
        tier.close()
    finally:
        cluster.cleanup()


def test_cluster_master_killed_then_restarted_recovers() -> None:
    cluster = RedisClusterServers().start()
    try:
        tier = open_tier(cluster.url, timeout_s=TIMEOUT_S)
        try:
            key = random_key()
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, 7), CONTRACT_CHUNK)
            holder = cluster.node_holding(tier.store.name_of(key))
            holder.kill()
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            answer, took = timed(lambda: tier.get_into(key, out))
            assert answer is None and took < TIMEOUT_S + SLACK_S
            holder.start()  # same directory: it rejoins with its nodes.conf, empty of data
            wait_until(cluster.all_ok, 30, "the cluster to heal")
            assert tier.store.link.wait_up(15.0), "tier did not reconnect to the healed cluster"
            wait_until(
                lambda: (
                    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 7), CONTRACT_CHUNK).outcome
                    is PutOutcome.STORED
                ),
                15,
                "a write to the restarted master",
            )
            assert tier.get_into(key, out) == CONTRACT_CHUNK
        finally:
            tier.close()
    finally:
        cluster.cleanup()


def test_engine_starts_with_its_redis_down_and_serves_from_cpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    config = small_config(remote_url=url, blocking_timeout_secs=TIMEOUT_S)
    tokens, kv = make_tokens(48, seed=4), make_kv(48, seed=4)
    with Engine(config, SMALL_LAYOUT, model_name="m") as engine:
        assert engine.store(tokens, kv) == 3  # into CPU; the redis writes are dropped
        assert engine.lookup(tokens, "r").tokens == 48
        assert torch.equal(engine.retrieve(tokens, "r"), kv)
        engine.end_request("r")
        stats = engine.stats()["tiers"]["redis"]
        assert stats["dropped"] == 3 and stats["stored"] == 0
        assert engine.check_invariants() == [] and engine.leaks() == []
    assert len(redis_warnings(caplog)) == 1, redis_warnings(caplog)


# -- Redis Cluster: one master killed, paused, restarted empty ---------------------------------
def test_cluster_master_paused_costs_at_most_the_timeout_then_recovers() -> None:
    cluster = RedisClusterServers().start()
    try:
        tier = open_tier(cluster.url, timeout_s=TIMEOUT_S)
        try:
            key = random_key()
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, 8), CONTRACT_CHUNK)
            holder = cluster.node_holding(tier.store.name_of(key))
            holder.pause()
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            answer, took = timed(lambda: tier.get_into(key, out))
            assert answer is None and took < TIMEOUT_S + SLACK_S
            answer, took = timed(lambda: tier.contains([key, random_key()]))
            assert answer == [False, False] and took < TIMEOUT_S + SLACK_S
            escaped, took = timed(lambda: exercise_every_public_call(tier))
            assert escaped == []
            holder.resume()
            assert tier.store.link.wait_up(15.0), "tier did not come back after the pause"
            wait_until(lambda: tier.get_into(key, out) == CONTRACT_CHUNK, 15, "the paused key")
            assert torch.equal(out, payload(CONTRACT_CHUNK, 8))
        finally:
            tier.close()
    finally:
        cluster.cleanup()


@pytest.mark.parametrize("fault", ["kill_then_restart_empty", "pause_then_resume"])
def test_engine_on_a_cluster_turns_a_master_fault_into_misses_and_recovers(fault: str) -> None:
    cluster = RedisClusterServers().start()
    try:
        config = small_config(
            remote_url=cluster.url, blocking_timeout_secs=TIMEOUT_S, local_cpu=False
        )
        tokens, kv = make_tokens(128, seed=12), make_kv(128, seed=12)
        with Engine(config, SMALL_LAYOUT, model_name="m") as writer:
            assert writer.store(tokens, kv) == 8
            assert writer.flush(10.0)
        with Engine(
            config.with_overrides(use_only_staging_buffer=True), SMALL_LAYOUT, model_name="m"
        ) as engine:
            tier = engine.tier("redis")
            assert isinstance(tier, RedisTier)
            first_key = engine.keychain.keys(tokens, include_partial=False)[0].key
            holder = cluster.node_holding(tier.store.name_of(first_key))  # holds chunk 0
            if fault == "kill_then_restart_empty":
                holder.kill()
            else:
                holder.pause()
            # Lookups and loads are misses, each bounded by the timeout: the engine
            # recomputes; nothing raises, nothing hangs.
            out = torch.zeros_like(kv)
            for rid in ("during-0", "during-1", "during-2"):
                start = time.monotonic()
                engine.lookup(tokens, rid)
                loaded = engine.retrieve_into(tokens, rid, out)
                assert loaded == 0  # chunk 0 is unreachable
                assert time.monotonic() - start < TIMEOUT_S + SLACK_S
                engine.end_request(rid)
                engine.store(tokens, kv)  # dropped or failed, never an error
            assert engine.check_invariants() == [] and engine.leaks() == []

            if fault == "kill_then_restart_empty":
                holder.start()  # same directory: it rejoins with its nodes.conf, empty
            else:
                holder.resume()
            wait_until(cluster.all_ok, 30, "the cluster to heal")
            assert tier.store.link.wait_up(15.0)

            def all_hit() -> bool:
                engine.store(tokens, kv)
                engine.flush(10.0)
                hit = engine.lookup(tokens, "after").tokens
                engine.end_request("after")
                return hit == 128

            wait_until(all_hit, 30, "every chunk to hit again")
            assert engine.lookup(tokens, "final").tokens == 128
            assert torch.equal(engine.retrieve(tokens, "final"), kv)
            engine.end_request("final")
            assert engine.check_invariants() == [] and engine.leaks() == []
    finally:
        cluster.cleanup()
