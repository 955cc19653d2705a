"""Per-request explain: the tier each chunk was found in, or the reason it missed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier import Engine
from kvtier.errors import ConfigError
from kvtier.observability import explain as ex
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


def outcomes(engine: Engine, request_id: str) -> list[str]:
    record = engine.observer.explain.get(request_id)
    assert record is not None
    return [f"found:{c['tier']}" if c["found"] else c["reason"] for c in record["chunks"]]


def test_found_tier_and_not_stored(engine: Engine) -> None:
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    prompt = tokens + make_tokens(40, seed=5)  # 2 hit chunks, 2 new chunks, 8 tail tokens
    engine.lookup(prompt, "r")
    assert outcomes(engine, "r") == [
        "found:cpu",
        "found:cpu",
        ex.NOT_STORED,
        ex.NOT_STORED,
        ex.PARTIAL,
    ]
    record = engine.observer.explain.get("r")
    assert record is not None
    assert record["prompt_tokens"] == 72 and record["found_tokens"] == 32
    assert record["loaded_tokens"] == 0 and "unused_tokens" not in record  # open, not loaded
    assert record["summary"] == {
        "found_chunks_by_tier": {"cpu": 2},
        "miss_chunks_by_reason": {ex.NOT_STORED: 2, ex.PARTIAL: 1},
    }
    assert [(c["start"], c["end"]) for c in record["chunks"]][-1] == (64, 72)
    spans = engine.keychain.keys(prompt, include_partial=False)
    assert [c["key"] for c in record["chunks"][:4]] == [s.key.hex() for s in spans]
    engine.end_request("r")


def test_evicted_from_cpu(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(cpu_chunks=2)
    first = make_tokens(32, seed=1)
    engine.store(first, make_kv(32, seed=1))
    engine.store(make_tokens(32, seed=2), make_kv(32, seed=2))  # evicts both chunks of `first`
    engine.lookup(first, "r")
    assert outcomes(engine, "r") == [ex.EVICTED, ex.EVICTED]
    record = engine.observer.explain.get("r")
    assert record is not None and "evicted from cpu" in record["chunks"][0]["detail"]
    engine.end_request("r")


def test_not_contiguous_after_an_evicted_chunk(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(cpu_chunks=4)
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))  # chunks 0, 1, 2; one page left
    engine.lookup(tokens[:16], "touch")  # chunk 0 becomes most recently used
    engine.end_request("touch")
    engine.store(make_tokens(32, seed=3), make_kv(32, seed=3))  # evicts the LRU: chunk 1
    engine.lookup(tokens, "r")
    assert outcomes(engine, "r") == ["found:cpu", ex.EVICTED, ex.NOT_CONTIGUOUS]
    record = engine.observer.explain.get("r")
    assert record is not None
    assert record["chunks"][1]["detail"].startswith("evicted from cpu at ")
    assert record["chunks"][2]["detail"] == "held by cpu, but chunk 1 before it missed"
    engine.end_request("r")


def test_stored_then_cleared_reads_as_evicted(engine: Engine) -> None:
    tokens = make_tokens(16, seed=11)
    engine.store(tokens, make_kv(16, seed=11))
    assert engine.clear() == {"cpu": 1}
    engine.lookup(tokens, "r")
    assert outcomes(engine, "r") == [ex.EVICTED]
    record = engine.observer.explain.get("r")
    assert record is not None
    detail = record["chunks"][0]["detail"]
    assert "no tier holds it now" in detail and "cleared" in detail
    # The CPU tier is the only one: no "lower tier" to blame (issue 58, item 10).
    assert "lower tier" not in detail and "write to" not in detail
    engine.end_request("r")


def test_a_vanished_chunk_names_the_lower_tiers_that_exist(tmp_path: Path) -> None:
    config = small_config(local_disk=str(tmp_path), max_local_disk_size="1MiB")
    with Engine(config, SMALL_LAYOUT, model_name="test-model") as engine:
        tokens = make_tokens(16, seed=12)
        engine.store(tokens, make_kv(16, seed=12))
        assert engine.flush(10)
        engine.clear()
        engine.lookup(tokens, "r")
        record = engine.observer.explain.get("r")
        assert record is not None
        detail = record["chunks"][0]["detail"]
        assert "cleared" in detail and "its write to disk" in detail
        assert "lower tier" not in detail and "shared" not in detail
        engine.end_request("r")


def test_a_shared_store_is_named_as_one_that_cannot_report_deletions() -> None:
    detail = ex.unreported_loss(lower=["disk", "redis"], shared=["redis"])
    assert "its write to disk or redis" in detail
    assert "deleted from redis outside this process" in detail
    assert "lower tier" not in ex.unreported_loss(lower=[], shared=[])


def test_fingerprint_mismatch_names_the_field(engine_factory: Callable[..., Engine]) -> None:
    salted = engine_factory(cache_salt="tenant-a")
    plain = engine_factory(model_name="test-model")
    tokens = make_tokens(32, seed=7)
    salted.store(tokens, make_kv(32, seed=7))
    plain.lookup(tokens, "r")
    assert outcomes(plain, "r") == [ex.FINGERPRINT_MISMATCH, ex.FINGERPRINT_MISMATCH]
    record = plain.observer.explain.get("r")
    assert record is not None
    assert record["chunks"][0]["detail"] == "stored under cache_salt 'tenant-a' (this engine: '')"
    plain.end_request("r")


def test_store_dropped_when_every_page_is_pinned(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(cpu_chunks=2)
    held = make_tokens(32, seed=1)
    engine.store(held, make_kv(32, seed=1))
    engine.lookup(held, "holder")  # pins both pages
    dropped = make_tokens(32, seed=2)
    engine.store(dropped, make_kv(32, seed=2))
    engine.lookup(dropped, "r")
    assert outcomes(engine, "r") == [ex.STORE_DROPPED, ex.STORE_DROPPED]
    engine.end_request("holder")
    engine.end_request("r")


def test_skip_leading_tokens_show_as_engine(engine: Engine) -> None:
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    engine.lookup(tokens, "r", skip_leading_tokens=16)
    assert outcomes(engine, "r") == ["found:engine", "found:cpu", "found:cpu"]
    engine.end_request("r")


def test_checksum_failure_at_retrieve(tmp_path: Path) -> None:
    config = small_config(
        cpu_chunks=4,
        local_cpu=False,
        use_only_staging_buffer=True,
        local_disk=str(tmp_path),
        max_local_disk_size=f"{16 * (CHUNK_BYTES + HEADER_SIZE)}B",
    )
    with Engine(config, SMALL_LAYOUT, model_name="test-model") as engine:
        tokens = make_tokens(48)
        engine.store(tokens, make_kv(48))
        assert engine.flush(10)
        second = engine.keychain.keys(tokens, include_partial=False)[1].key
        for name in os.listdir(tmp_path):
            if second.hex() in name:
                with open(tmp_path / name, "r+b") as f:
                    f.seek(HEADER_SIZE + 3)
                    f.write(b"\x00\x01\x02\x03")
        assert engine.lookup(tokens, "r").tokens == 48
        assert outcomes(engine, "r") == ["found:disk", "found:disk", "found:disk"]
        assert engine.retrieve(tokens, "r").shape[2] == 16
        assert outcomes(engine, "r") == ["found:disk", ex.CHECKSUM_FAILURE, ex.NOT_CONTIGUOUS]
        engine.end_request("r")
        # a later request is told the chunk failed its checksum (the tier removed it)
        engine.lookup(tokens, "again")
        assert outcomes(engine, "again") == ["found:disk", ex.CHECKSUM_FAILURE, ex.NOT_CONTIGUOUS]
        engine.end_request("again")


def test_ring_is_bounded_and_keeps_the_newest(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(extra_config={"explain_requests": 3})
    tokens = make_tokens(16)
    for i in range(5):
        engine.lookup(tokens, f"r{i}")
        engine.end_request(f"r{i}")
    log = engine.observer.explain
    assert len(log) == 3
    assert log.get("r0") is None and log.get("r4") is not None
    assert [r["request_id"] for r in log.recent(10)] == ["r4", "r3", "r2"]
    engine.lookup(tokens, "r4")
    record = log.get("r4")
    assert record is not None and record["lookups"] == 2


def test_explain_can_be_turned_off(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(extra_config={"explain_requests": 0})
    engine.lookup(make_tokens(16), "r")
    assert engine.observer.explain.get("r") is None
    engine.end_request("r")


@pytest.mark.parametrize("bad", [-1, "10", 1.5, True, 10**7])
def test_bad_explain_size_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"extra_config\.explain_requests"):
        Engine(small_config(extra_config={"explain_requests": bad}), SMALL_LAYOUT, model_name="m")


def test_key_memory_is_bounded() -> None:
    from kvtier.fingerprint import Fingerprint

    log = ex.ExplainLog(
        Fingerprint("m", SMALL_LAYOUT, SMALL_CHUNK), save_unfull_chunk=False, key_memory=4
    )
    log.note_evicted("cpu", [bytes([i]) * 16 for i in range(10)])
    assert len(log._fate) == 4


def test_the_id_a_vllm_client_knows_finds_the_internal_record(engine: Engine) -> None:
    """vLLM answers cmpl-<id>; it runs the request as cmpl-<id>-0-<suffix> (a kvtier server
    keys it c<conn>/...): explain takes the client's id."""
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    engine.lookup(tokens, "cmpl-abc123-0-9f8e7d6c")
    engine.lookup(tokens, "c7/cmpl-srv42-0-01234567")
    engine.lookup(tokens, "cmpl-abc1234-0-00000000")  # another request sharing the prefix
    for asked, internal in (
        ("cmpl-abc123", "cmpl-abc123-0-9f8e7d6c"),
        ("cmpl-abc123-0-9f8e7d6c", "cmpl-abc123-0-9f8e7d6c"),
        ("cmpl-srv42", "c7/cmpl-srv42-0-01234567"),
    ):
        record = engine.observer.explain.get(asked)
        assert record is not None and record["request_id"] == internal
    assert engine.observer.explain.get("cmpl-abc") is None  # a prefix of an id is not an id
    for rid in ("cmpl-abc123-0-9f8e7d6c", "c7/cmpl-srv42-0-01234567", "cmpl-abc1234-0-00000000"):
        engine.end_request(rid)


def test_explain_names_what_keyed_a_request_apart(engine: Engine) -> None:
    """Equal tokens under an adapter are other chunks: the record says why they missed."""
    from kvtier.request_salt import ExtraKeys

    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    adapter = ExtraKeys(adapter=b"B" * 16, labels=("lora adapter 'B'",))
    engine.lookup(tokens, "lora", cache_salt=adapter)
    engine.lookup(tokens, "salted", cache_salt="tenant")
    engine.lookup(tokens, "plain")
    for rid, why, hit in [
        ("lora", "lora adapter 'B'", 0),
        ("salted", "cache salt", 0),
        ("plain", None, 32),
    ]:
        record = engine.observer.explain.get(rid)
        assert (
            record is not None and record.get("keyed_by") == why and record["found_tokens"] == hit
        )
        engine.end_request(rid)


def test_a_record_counts_found_loaded_and_unused_as_the_counters_do(engine: Engine) -> None:
    """found: in kvtier's tiers beyond the skip; loaded: copied since; unused: at the end."""
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    with engine.request("used"):
        engine.lookup(tokens, "used", skip_leading_tokens=16)
        engine.retrieve_into(tokens, "used", make_kv(48) * 0, skip_leading_tokens=16)
    with engine.request("unused"):
        engine.lookup(tokens, "unused")
    used, unused = engine.observer.explain.get("used"), engine.observer.explain.get("unused")
    assert used is not None and unused is not None
    assert (used["found_tokens"], used["loaded_tokens"], used["unused_tokens"]) == (32, 32, 0)
    assert (unused["found_tokens"], unused["loaded_tokens"], unused["unused_tokens"]) == (48, 0, 48)
    stats = engine.stats()
    assert stats["found_tokens"] == 32 + 48 and stats["hit_tokens"] == 32
    assert stats["unused_tokens"] == 48
    recent = {r["request_id"]: r for r in engine.observer.explain.recent(5)}
    counts = {"prompt_tokens": 48, "found_tokens": 32, "loaded_tokens": 32, "unused_tokens": 0}
    assert recent["used"] == {"request_id": "used", "time": used["time"], **counts}
