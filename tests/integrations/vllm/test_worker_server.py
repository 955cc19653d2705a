"""The connector's worker side on a real ``kvtier server`` (``server`` in the extra config),
with real paged tensors and no vLLM processes: what one worker saves another loads, leases
are per (worker connection, vLLM request id), end once through the channel, and a worker that
goes away leaves nothing held in the server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import Hit, LookupClient
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.layout import KVLayout
from kvtier.server.client import ServerClient
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    idle_server_state,
    remove_tempdir,
    short_tempdir,
    wait_until,
)

from .worker_helpers import (
    BLOCK,
    CHUNK,
    CHUNK_BYTES,
    DIM,
    HEADS,
    LAYERS,
    fill,
    make_worker,
)

LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)


@pytest.fixture(scope="module")
def kvserver() -> Iterator[ServerProcess]:
    path = short_tempdir()
    proc = ServerProcess(path, max_local_cpu_size=f"{64 * CHUNK_BYTES}B").start()
    yield proc
    proc.stop()
    remove_tempdir(path)


def config(**overrides: object) -> Config:
    return Config.load(overrides={"chunk_size": CHUNK, **overrides}, env={})


def server_worker(url: str, **overrides: object) -> WorkerSide:
    return make_worker(model_name="tiny-server", server=url, **overrides)


def test_one_worker_loads_what_another_saved_and_leases_end_once(kvserver: ServerProcess) -> None:
    checker = ServerClient(kvserver.url, LAYOUT, model_name="tiny-server", config=config()).open()
    first, second = server_worker(kvserver.url), server_worker(kvserver.url)
    a, b = LookupClient(first.engine_id), LookupClient(second.engine_id)
    try:
        assert first.engine is None and second.engine is None  # no Engine in the worker
        tokens = list(range(500, 580))  # 2 whole chunks + 16
        fill(first, [3, 4, 5, 6], seed=7)
        first.save(KVTierMetadata(saves=[SaveSpec("s", tokens[:64], [3, 4, 5, 6], 0, 64)]))
        # one event for both chunks, in the media the server has (only its CPU tier here)
        events = first.take_events()
        assert [(e[0], e[5]) for e in events] == [("stored", "CPU")]
        assert len(events[0][1]) == 64 // events[0][4]  # every block of both chunks

        # the same vLLM request id in both workers: two leases, one per connection
        # the CPU share crosses the server too (wire.Hit): a CPU hit loads in the step
        assert a.lookup("same", tokens) == Hit(64, 64)
        assert b.lookup("same", tokens) == Hit(64, 64)
        assert checker.stats()["open_requests"] == 2
        assert checker.stats()["pinned_pages"] == 4

        second.load(KVTierMetadata(loads=[LoadSpec("same", tokens, [20, 21, 22, 23], 0, 64)]))
        assert first.paged is not None and second.paged is not None
        for mine, theirs in zip(second.paged.layers, first.paged.layers, strict=True):
            assert torch.equal(mine[[20, 21, 22, 23]], theirs[[3, 4, 5, 6]])
        assert second.failed_blocks() == set() and second.short_loads() == {}

        assert a.end("same") is True
        assert checker.stats()["open_requests"] == 1  # b's lease of "same" is its own
        assert b.end("same") is True
        assert b.end("same") is False  # ended exactly once
        assert idle_server_state(checker) == IDLE

        # a worker that goes away with a lease open releases it in the server
        assert b.lookup("open", tokens) == Hit(64, 64)
        assert checker.stats()["pinned_pages"] == 2
        b.close()
        second.close()
        # the server notices the closed socket on its own thread, a moment later
        wait_until(lambda: checker.stats()["open_requests"] == 0, what="the lease released")
        assert idle_server_state(checker) == IDLE
        with pytest.raises(Exception, match="kvtier server"):
            a.leaks()
    finally:
        a.close()
        b.close()
        first.close()
        second.close()
        checker.close()


def test_server_and_pd_are_refused_together(kvserver: ServerProcess) -> None:
    with pytest.raises(ConfigError, match="enable_pd"):
        WorkerSide(
            config(enable_pd=True, pd_role="receiver", pd_buffer_size="1MiB"),
            model_name="tiny-server",
            engine_id="x",
            tp_rank=0,
            tp_world_size=1,
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_dim=DIM,
            server=kvserver.url,
        )


def test_vllm_metrics_export_no_kvtier_counters_when_the_cache_is_a_server() -> None:
    """Through a kvtier server the worker counts nothing itself: vLLM's /metrics would show
    vllm:kvtier_* stuck at 0. It shows none; the server's /metrics has the figures."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig

    from kvtier.integrations.vllm.connector import KVTierConnector

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"server": "unix:///run/kvtier/kvtier.sock"},
    )
    # The registry is process-wide: an earlier test's vLLM may have registered its own
    # kvtier metrics, so what counts is what this connector adds.
    before = {m.name for m in REGISTRY.collect()}
    metrics = KVTierConnector.build_prom_metrics(
        VllmConfig(kv_transfer_config=transfer),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    assert metrics.counters == {}  # type: ignore[attr-defined]
    metrics.observe({"hit_tokens": 5})  # a stray report is dropped, not an error
    added = {m.name for m in REGISTRY.collect()} - before
    assert not any(name.startswith("vllm:kvtier") for name in added)


def test_a_cache_salt_crosses_the_server(kvserver: ServerProcess) -> None:
    """The salt travels in Lookup, Retrieve and Reserve: a chunk stored for one salt is
    never served to another through the server either."""
    checker = ServerClient(kvserver.url, LAYOUT, model_name="tiny-server", config=config()).open()
    first, second = server_worker(kvserver.url), server_worker(kvserver.url)
    client = LookupClient(second.engine_id)
    try:
        tokens = list(range(900, 980))
        fill(first, [3, 4, 5, 6], seed=8)
        spec = SaveSpec("s", tokens[:64], [3, 4, 5, 6], 0, 64, None, "tenant-A")
        first.save(KVTierMetadata(saves=[spec]))
        assert client.lookup("b", tokens, "tenant-B").tokens == 0
        assert client.lookup("n", tokens).tokens == 0
        assert client.lookup("a", tokens, "tenant-A").tokens == 64
        load = LoadSpec("a", tokens, [20, 21, 22, 23], 0, 64, cache_salt="tenant-A")
        second.load(KVTierMetadata(loads=[load]))
        assert second.paged is not None and first.paged is not None
        for mine, theirs in zip(second.paged.layers, first.paged.layers, strict=True):
            assert torch.equal(mine[[20, 21, 22, 23]], theirs[[3, 4, 5, 6]])
        for rid in ("a", "b", "n"):
            client.end(rid)
        assert idle_server_state(checker) == IDLE
    finally:
        client.close()
        first.close()
        second.close()
        checker.close()
