"""The Prometheus collector: exact values after known operations, read at scrape time."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import Engine
from kvtier.observability.metrics import PD_FIELDS, engine_registry, pd_view
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)  # 4096
TOKEN_BYTES = SMALL_LAYOUT.token_bytes()  # 256


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_counts_after_one_store_and_one_partial_hit(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(cpu_chunks=8)
    reg = engine_registry(engine)
    tokens = make_tokens(48)
    assert engine.store(tokens, make_kv(48)) == 3
    prompt = tokens[:32] + make_tokens(16, seed=9)  # chunks 0 and 1 hit, chunk 2 is new
    assert engine.lookup(prompt, "r1").tokens == 32

    assert value(reg, "kvtier_stores_total") == 1
    assert value(reg, "kvtier_stored_chunks_total") == 3
    assert value(reg, "kvtier_tier_stored_chunks_total", tier="cpu") == 3
    assert value(reg, "kvtier_tier_stored_bytes_total", tier="cpu") == 3 * CHUNK_BYTES
    assert value(reg, "kvtier_tier_used_bytes", tier="cpu") == 3 * CHUNK_BYTES
    assert value(reg, "kvtier_tier_capacity_bytes", tier="cpu") == 8 * CHUNK_BYTES
    assert value(reg, "kvtier_tier_entries", tier="cpu") == 3
    assert value(reg, "kvtier_lookups_total") == 1
    assert value(reg, "kvtier_lookup_requested_tokens_total") == 48
    assert value(reg, "kvtier_lookup_found_tokens_total") == 32
    assert value(reg, "kvtier_lookup_hit_tokens_total") == 0  # found, not loaded (yet)
    assert value(reg, "kvtier_lookup_tier_hit_tokens_total", tier="cpu") == 32
    assert value(reg, "kvtier_open_leases") == 1
    assert value(reg, "kvtier_pinned_chunks") == 2
    assert value(reg, "kvtier_pinned_bytes") == 2 * CHUNK_BYTES
    assert value(reg, "kvtier_oldest_lease_age_seconds") > 0  # type: ignore[operator]
    assert value(reg, "kvtier_allocator_free_pages") == 5
    assert value(reg, "kvtier_lookup_duration_seconds_count") == 1
    assert value(reg, "kvtier_store_duration_seconds_count") == 1
    assert value(reg, "kvtier_retrieve_duration_seconds_count") == 0

    kv = engine.retrieve(prompt, "r1")  # reuses the lookup's plan: no second lookup
    assert kv.shape[2] == 32
    assert value(reg, "kvtier_lookups_total") == 1
    assert value(reg, "kvtier_retrieved_tokens_total") == 32
    assert value(reg, "kvtier_loaded_tokens_total", tier="cpu") == 32
    assert value(reg, "kvtier_retrieved_bytes_total", tier="cpu") == 32 * TOKEN_BYTES
    assert value(reg, "kvtier_retrieve_duration_seconds_count") == 1
    assert value(reg, "kvtier_requests_total") == 0

    assert engine.end_request("r1")
    assert not engine.end_request("r1")  # the second end is a no-op, counted nowhere
    assert value(reg, "kvtier_requests_total") == 1
    assert value(reg, "kvtier_open_leases") == 0
    assert value(reg, "kvtier_pinned_bytes") == 0
    assert value(reg, "kvtier_oldest_lease_age_seconds") == 0
    assert value(reg, "kvtier_lease_duration_seconds_count") == 1
    assert value(reg, "kvtier_lease_duration_seconds_bucket", le="+Inf") == 1


def test_scrapes_do_not_change_values(engine: Engine) -> None:
    reg = engine_registry(engine)
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    first = generate_latest(reg)
    second = generate_latest(reg)
    assert first == second
    assert value(reg, "kvtier_stored_chunks_total") == 2


def test_evictions_and_dropped_stores(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(cpu_chunks=4)
    reg = engine_registry(engine)
    engine.store(make_tokens(64, seed=1), make_kv(64, seed=1))  # fills all 4 pages
    engine.store(make_tokens(32, seed=2), make_kv(32, seed=2))  # evicts the 2 oldest
    assert value(reg, "kvtier_tier_evictions_total", tier="cpu") == 2
    assert value(reg, "kvtier_dropped_chunks_total") == 0

    held = make_tokens(64, seed=3)
    engine.store(held, make_kv(64, seed=3))  # evicts 4 more
    assert value(reg, "kvtier_tier_evictions_total", tier="cpu") == 6
    assert engine.lookup(held, "pin-all").tokens == 64  # every page pinned now
    engine.store(make_tokens(48, seed=4), make_kv(48, seed=4))
    assert value(reg, "kvtier_dropped_chunks_total") == 3
    assert value(reg, "kvtier_tier_evictions_total", tier="cpu") == 6
    engine.end_request("pin-all")


def test_checksum_failure_on_disk_is_counted(tmp_path: Path) -> None:
    config = small_config(
        cpu_chunks=4,
        local_cpu=False,
        use_only_staging_buffer=True,
        local_disk=str(tmp_path),
        max_local_disk_size=f"{16 * (CHUNK_BYTES + HEADER_SIZE)}B",
    )
    with Engine(config, SMALL_LAYOUT, model_name="test-model") as engine:
        reg = engine_registry(engine)
        tokens = make_tokens(32)
        engine.store(tokens, make_kv(32))
        assert engine.flush(10)
        assert value(reg, "kvtier_tier_stored_chunks_total", tier="disk") == 2
        assert value(reg, "kvtier_tier_writes_total", tier="disk", outcome="stored") == 2
        first = engine.keychain.keys(tokens, include_partial=False)[0].key.hex()
        for name in os.listdir(tmp_path):  # flip a payload byte of chunk 0's file
            if first in name:
                with open(tmp_path / name, "r+b") as f:
                    f.seek(HEADER_SIZE + 10)
                    byte = f.read(1)
                    f.seek(HEADER_SIZE + 10)
                    f.write(bytes([byte[0] ^ 0xFF]))
        assert engine.lookup(tokens, "r").tokens == 32  # the index still lists both
        assert engine.retrieve(tokens, "r").shape[2] == 0  # chunk 0 fails its checksum
        assert value(reg, "kvtier_tier_checksum_failures_total", tier="disk") == 1
        assert value(reg, "kvtier_load_failures_total") == 1
        engine.end_request("r")


def test_ttft_reports_and_estimate(engine: Engine) -> None:
    reg = engine_registry(engine)
    engine.record_ttft(0.5, prompt_tokens=1000, hit_tokens=0)  # 0.5 ms per prefilled token
    engine.record_ttft(0.25, prompt_tokens=1000, hit_tokens=500)
    assert value(reg, "kvtier_ttft_seconds_count") == 2
    assert value(reg, "kvtier_ttft_seconds_sum") == 0.75
    # 0.75 s over 1500 prefilled tokens; 500 hit tokens would have cost 0.25 s
    assert abs(value(reg, "kvtier_ttft_saved_seconds_estimate") - 0.25) < 1e-12  # type: ignore[operator]


class _PdEngine(Engine):
    """An engine whose stats carry a PD section, as the PD receiver reports it."""

    pd: ClassVar[dict[str, Any]] = {}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pd": self.pd}


def test_pd_fields_become_metrics() -> None:
    with _PdEngine(small_config(), SMALL_LAYOUT, model_name="test-model") as engine:
        reg = engine_registry(engine)
        assert value(reg, "kvtier_pd_buffer_used_bytes") is None  # nothing reported: no metric
        _PdEngine.pd = {
            "buffer_used_bytes": 8192,
            "buffer_capacity_bytes": 65536,
            "received_bytes": 123,
            "transfers": 4,
            "failures": 1,
            "auth_failures": 2,
            "timeouts": 3,
            "protocol_errors": 5,
            "expired_reservations": 6,
            "role": "receiver",  # not a number: ignored
        }
        assert value(reg, "kvtier_pd_buffer_used_bytes") == 8192
        assert value(reg, "kvtier_pd_buffer_capacity_bytes") == 65536
        assert value(reg, "kvtier_pd_received_bytes_total") == 123
        assert value(reg, "kvtier_pd_transfers_total") == 4
        assert value(reg, "kvtier_pd_transfer_failures_total") == 1
        assert value(reg, "kvtier_pd_auth_failures_total") == 2
        assert value(reg, "kvtier_pd_timeouts_total") == 3
        assert value(reg, "kvtier_pd_protocol_errors_total") == 5
        assert value(reg, "kvtier_pd_expired_reservations_total") == 6
        assert len(PD_FIELDS) == 9


def test_every_metric_is_named_by_convention(engine: Engine) -> None:
    engine.store(make_tokens(32), make_kv(32))
    text = generate_latest(engine_registry(engine)).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) > 30
    for family in families:
        assert family.name.startswith("kvtier_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name


def test_closed_engine_scrapes_empty() -> None:
    engine = Engine(small_config(), SMALL_LAYOUT, model_name="test-model")
    reg = engine_registry(engine)
    assert generate_latest(reg) == b""  # not open yet
    engine.open()
    assert value(reg, "kvtier_lookups_total") == 0
    engine.close()
    assert generate_latest(reg) == b""


def test_pd_view_reads_the_decoder_pd_tier() -> None:
    assert pd_view({"tiers": {"cpu": {}}}) is None
    tier = {"used_bytes": 4096, "capacity_bytes": 65536, "bytes_written": 12288}
    tier["transfers"], tier["transfer_failures"] = 3, 1
    assert pd_view({"tiers": {"pd": tier}}) == {
        "buffer_used_bytes": 4096,
        "buffer_capacity_bytes": 65536,
        "received_bytes": 12288,
        "transfers": 3,
        "failures": 1,
    }
    reported = {"received_bytes": 99}
    view = pd_view({"tiers": {"pd": tier}, "pd": reported})
    assert view is not None and view["received_bytes"] == 99 and view["transfers"] == 3


def test_tier_available_drops_to_zero_while_the_disk_directory_is_gone(
    engine_factory: Callable[..., Engine], tmp_path: Path
) -> None:
    import shutil

    disk = tmp_path / "disk"
    engine = engine_factory(local_disk=str(disk), max_local_disk_size="1MiB")
    reg = engine_registry(engine)
    assert value(reg, "kvtier_tier_available", tier="disk") == 1
    assert value(reg, "kvtier_tier_available", tier="cpu") == 1
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    assert engine.flush(10)
    shutil.rmtree(disk)
    engine.lookup(make_tokens(32, seed=7), "r")  # a CPU miss asks the disk, which notices
    engine.end_request("r")
    assert value(reg, "kvtier_tier_available", tier="disk") == 0
    assert engine.stats()["tiers"]["disk"]["directory_lost"] == 1


def test_the_hit_is_what_was_loaded_and_found_but_unneeded_is_its_own_counter(
    engine_factory: Callable[..., Engine],
) -> None:
    """As inside vLLM when its own prefix cache serves a repeat: kvtier finds the prefix, the
    engine never loads it. The hit counter must stay at the tokens actually loaded."""
    engine = engine_factory(cpu_chunks=8)
    reg = engine_registry(engine)
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    with engine.request("loads"):
        assert engine.lookup(tokens, "loads").tokens == 48
        engine.retrieve(tokens, "loads")
    with engine.request("engine-had-it"):
        assert engine.lookup(tokens, "engine-had-it").tokens == 48  # found, never retrieved
    assert value(reg, "kvtier_lookup_found_tokens_total") == 96
    assert value(reg, "kvtier_lookup_hit_tokens_total") == 48
    assert value(reg, "kvtier_retrieved_tokens_total") == 48
    assert value(reg, "kvtier_found_unused_tokens_total") == 48
    stats = engine.stats()
    assert stats["hit_tokens"] == stats["retrieved_tokens"] == 48
    assert stats["unused_tokens"] == 48 and stats["found_tokens"] == 96
