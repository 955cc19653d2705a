"""The connector's two sides with a real Engine and real paged tensors, without vLLM's
processes: the socket protocol, loads, saves, short loads, events and the ended-request
guard (fast, so every rule has a test that runs in a second)."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import Config
from kvtier.integrations.vllm.events import block_names, to_vllm
from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import Hit, LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.request_salt import ExtraKeys
from kvtier.service import Service

LAYERS, HEADS, DIM, BLOCK, BLOCKS, CHUNK = 2, 2, 8, 16, 64, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * DIM * 4


def kv_caches() -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for i in range(LAYERS)
    }


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    side = make_worker()
    yield side
    side.close()


def make_worker(
    *, model_name: str = "tiny", groups: ModelGroups | None = None, **overrides: object
) -> WorkerSide:
    """A registered worker with events on; ``groups``: vLLM's KV-cache groups (None: one)."""
    values = {"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * CHUNK_BYTES}B", **overrides}
    side = WorkerSide(
        Config.load(overrides=values, env={}),
        model_name=model_name,
        engine_id=f"test-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        events=True,
        groups=groups,
    )
    side.register(kv_caches())
    return side


def fill(worker: WorkerSide, blocks: list[int], seed: int) -> None:
    assert worker.paged is not None
    gen = torch.Generator().manual_seed(seed)
    for layer in worker.paged.layers:
        layer[blocks] = torch.randn(len(blocks), HEADS, BLOCK, 2 * DIM, generator=gen)


def test_a_requests_line_says_what_its_saves_stored(
    worker: WorkerSide, caplog: pytest.LogCaptureFixture
) -> None:
    """What a save stored is kept on the request's lease (in-process) and written in the
    request's one line when the scheduler ends it; a save of a request with no lease keeps
    nothing anywhere."""
    tokens = list(range(300, 380))  # 80 tokens: 2 whole chunks + 16
    fill(worker, [3, 4, 5, 6, 7], seed=2)
    client = LookupClient(worker.engine_id)
    with caplog.at_level(logging.INFO, logger="kvtier.requests"):
        assert client.lookup("r", tokens, None).tokens == 0  # opens the request's lease
        worker.save(KVTierMetadata(saves=[SaveSpec("r", tokens[:64], [3, 4, 5, 6, 7], 0, 64)]))
        worker.save(KVTierMetadata(saves=[SaveSpec("gone", tokens[:64], [3, 4, 5, 6, 7], 0, 64)]))
        assert client.end("r") and not client.end("gone")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.requests"]
    assert lines == ["request r: 80 prompt tokens, loaded 0 tokens from kvtier, stored 64 new"]
    client.close()


def test_save_lookup_load_round_trip_through_the_socket(worker: WorkerSide) -> None:
    assert worker.paged is not None and worker.engine is not None
    tokens = list(range(100, 180))  # 80 tokens: 2 whole chunks + 16
    src = [3, 4, 5, 6, 7]
    fill(worker, src, seed=1)
    worker.save(KVTierMetadata(saves=[SaveSpec("r1", tokens[:64], src, 0, 64)]))

    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    request = SimpleNamespace(request_id="r2", prompt_token_ids=tokens)
    # beyond vLLM's own block, all in the CPU tier: loaded in the step
    assert scheduler.num_new_matched_tokens(request, 16) == (64 - 16, False)
    dst = [20, 21, 22, 23, 24]
    scheduler.after_alloc(request, dst, 48)
    out = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id="r2", prompt_token_ids=tokens, block_ids=(dst,), num_computed_tokens=16
            )
        ],
        num_scheduled_tokens={"r2": 16},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    meta = scheduler.build_meta(out)
    assert meta.loads == [LoadSpec("r2", tokens, dst, 16, 64)] and meta.saves == []
    worker.load(meta)
    for layer in worker.paged.layers:
        assert torch.equal(layer[dst[1:4]], layer[src[1:4]])  # tokens 16..63
        assert not layer[dst[0]].any()  # vLLM's own block is never written
    assert worker.failed_blocks() == set() and worker.short_loads() == {}

    assert worker.engine.stats()["pinned_pages"] == 2
    scheduler.finished("r2")
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    scheduler.finished("r2")  # a second end is a no-op
    assert worker.engine.stats()["requests"] == 1
    scheduler.close()


def test_a_load_for_an_ended_request_is_skipped_and_reported(worker: WorkerSide) -> None:
    tokens = list(range(64))
    fill(worker, [1, 2, 3, 4], seed=2)
    worker.save(KVTierMetadata(saves=[SaveSpec("a", tokens, [1, 2, 3, 4], 0, 64)]))
    client = LookupClient(worker.engine_id)
    assert client.lookup("b", tokens) == Hit(64, 64)  # hit, of which in the CPU tier
    assert client.end("b") is True
    worker.load(KVTierMetadata(loads=[LoadSpec("b", tokens, [9, 10, 11, 12], 0, 48)]))
    assert worker.failed_blocks() == {9, 10, 11}
    assert worker.short_loads() == {"b": 0}
    assert client.leaks() == []  # the late load opened no lease
    client.close()


def test_a_short_load_skips_that_requests_saves_in_the_step(worker: WorkerSide) -> None:
    tokens = list(range(64))
    meta = KVTierMetadata(
        loads=[LoadSpec("x", tokens, [1, 2, 3, 4], 0, 48)],  # x never looked up: fails
        saves=[SaveSpec("x", tokens, [1, 2, 3, 4], 0, 64)],
    )
    worker.load(meta)
    worker.save(meta)
    assert worker.failed_blocks() == {1, 2, 3}
    assert worker.engine is not None and worker.engine.stats()["stored_chunks"] == 0


def test_stores_and_evictions_become_vllm_events(worker: WorkerSide) -> None:
    for n in range(10):  # 10 chunks into 8 pages: the oldest two are evicted
        tokens = [1000 * n + t for t in range(CHUNK)]
        fill(worker, [1, 2], seed=n)
        worker.save(KVTierMetadata(saves=[SaveSpec(f"s{n}", tokens, [1, 2], 0, CHUNK)]))
    events = to_vllm(worker.take_events())
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert len(stored) == 10 and {e.medium for e in stored} == {"CPU"}
    # one chunk, in vLLM-sized blocks (what the router's --kv-event-block-size matches)
    assert stored[0].token_ids == list(range(CHUNK)) and stored[0].block_size == BLOCK
    assert len(stored[0].block_hashes) == CHUNK // BLOCK
    assert len(removed) == 2 and removed[0].block_hashes == stored[0].block_hashes
    assert worker.take_events() == []


def test_disk_hits_load_in_the_background(tmp_path: Path) -> None:
    """A hit that is on disk only: the scheduler says async, the load runs on the loader
    thread, and the worker reports the request finished when the blocks are filled."""
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": f"{64 * CHUNK_BYTES}B"}
    tokens = list(range(500, 580))
    first = make_worker(**disk)
    fill(first, [3, 4, 5, 6], seed=4)
    first.save(KVTierMetadata(saves=[SaveSpec("w", tokens[:64], [3, 4, 5, 6], 0, 64)]))
    assert first.paged is not None
    expected = [layer[[3, 4, 5, 6]].clone() for layer in first.paged.layers]
    first.close()  # drains the disk writes

    second = make_worker(**disk)  # a restart: CPU empty, the disk index rebuilt
    try:
        scheduler = SchedulerSide(
            [LookupClient(second.engine_id)],
            block_size=BLOCK,
            chunk_size=CHUNK,
            loads=True,
            saves=True,
        )
        request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 0) == (64, True)
        in_step = SchedulerSide(
            [LookupClient(second.engine_id)],
            block_size=BLOCK,
            chunk_size=CHUNK,
            loads=True,
            saves=True,
            async_lower_loads=False,
        )
        other = SimpleNamespace(request_id="r-sync", prompt_token_ids=tokens)
        assert in_step.num_new_matched_tokens(other, 0) == (64, False)  # the opt-out
        in_step.finished("r-sync")
        in_step.close()
        dst = [30, 31, 32, 33, 34]
        scheduler.after_alloc(request, dst, 64)
        # vLLM does not schedule a request waiting for its KV, yet the load goes out.
        out = SimpleNamespace(
            preempted_req_ids=None,
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        )
        meta = scheduler.build_meta(out)
        assert [(s.request_id, s.async_load) for s in meta.loads] == [("r", True)]
        second.load(meta)
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while "r" not in done and time.monotonic() < deadline:
            done |= second.finished_loads()
            time.sleep(0.01)
        assert done == {"r"} and second.failed_blocks() == set()
        assert second.paged is not None
        for layer, want in zip(second.paged.layers, expected, strict=True):
            assert torch.equal(layer[dst[:4]], want)
        scheduler.finished("r")
        assert second.engine is not None
        assert second.engine.leaks() == [] and second.engine.check_invariants() == []
        scheduler.close()
    finally:
        second.close()


def test_an_end_during_a_load_waits_for_it(worker: WorkerSide) -> None:
    tokens = list(range(64))
    fill(worker, [1, 2, 3, 4], seed=5)
    worker.save(KVTierMetadata(saves=[SaveSpec("a", tokens, [1, 2, 3, 4], 0, 64)]))
    client = LookupClient(worker.engine_id)
    assert client.lookup("b", tokens).tokens == 64
    assert worker.engine is not None
    with worker.engine.loading("b") as live:  # a load of b is running...
        assert live
        assert client.end("b") is True  # ...so the end is deferred:
        assert worker.engine.stats()["pinned_pages"] == 2  # the pins stay while it copies
    assert worker.engine.stats()["pinned_pages"] == 0 and worker.engine.leaks() == []
    with worker.engine.loading("b") as live:
        assert not live  # ended: a late load is refused
    client.close()


def test_the_worker_that_owns_the_cache_serves_its_admin_api() -> None:
    side = make_worker(internal_api_server_enabled=True, internal_api_server_port_start=0)
    try:
        assert side.admin is not None
        url = side.admin.url
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            assert json.loads(reply.read()) == {"status": "ok"}
        with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
            assert b"kvtier_lookups_total" in reply.read()
    finally:
        side.close()
    assert side.admin is None
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)


def test_a_decoder_worker_receives_through_its_service_and_closes_the_receiver_with_it() -> None:
    """The worker opens no PD receiver itself: it opens a Service, which opens the
    receiver after the engine (pd_role receiver) and closes it before, on worker.close()."""
    side = make_worker(enable_pd=True, pd_role="receiver", pd_buffer_size=f"{4 * CHUNK_BYTES}B")
    try:
        assert isinstance(side.service, Service) and side.engine is side.service.local_engine
        assert side.cache is side.service.cache is side.engine
        receiver = side.service.receiver
        assert receiver is not None
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5):
            pass  # it listens
    finally:
        side.close()
    assert side.service.receiver is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", receiver.port), timeout=2).close()


def test_counter_deltas_report_each_increase_once_and_nothing_on_idle_steps(
    worker: WorkerSide,
) -> None:
    """vLLM asks for the counters every step (its /metrics); an idle step reports nothing."""
    assert worker.counter_deltas() == {}
    tokens = list(range(64))
    fill(worker, [1, 2, 3, 4], seed=3)
    worker.save(KVTierMetadata(saves=[SaveSpec("s", tokens, [1, 2, 3, 4], 0, 64)]))
    assert worker.counter_deltas() == {"stored_chunks": 2}
    assert worker.counter_deltas() == {}  # a decode step: nothing moved
    client = LookupClient(worker.engine_id)
    assert client.lookup("t", tokens).tokens == 64
    client.end("t")
    client.close()
    assert worker.counter_deltas() == {
        "lookups": 1,
        "lookup_tokens": 64,
        "found_tokens": 64,
        "unused_tokens": 64,  # found, then ended without a load
    }
    assert worker.counter_deltas() == {}
    # an idle step also answers the load reports without finding anything
    assert worker.finished_loads() == set() and worker.failed_blocks() == set()
    assert worker.short_loads() == {}


def test_a_requests_cache_salt_keys_its_lookup_load_save_and_events(worker: WorkerSide) -> None:
    """vLLM's per-request cache_salt: what a request salted "A" saved is a miss for "B" and
    for no salt, a hit for "A"; its events carry the salted keys."""
    assert worker.engine is not None and worker.paged is not None
    tokens = list(range(300, 380))
    fill(worker, [3, 4, 5, 6], seed=11)
    worker.save(KVTierMetadata(saves=[SaveSpec("s", tokens[:64], [3, 4, 5, 6], 0, 64, None, "A")]))
    stored = [e for e in worker.take_events() if e[0] == "stored"]
    salted = [
        s.key for s in worker.engine.keychain.keys(tokens[:64], include_partial=False, salt="A")
    ]
    named = [name for key in salted for name in block_names(key, CHUNK // BLOCK)]
    assert [name for e in stored for name in e[1]] == named
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    for rid, salt in (("b", "B"), ("none", None)):
        request = SimpleNamespace(request_id=rid, prompt_token_ids=tokens, cache_salt=salt)
        assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
    request = SimpleNamespace(request_id="a", prompt_token_ids=tokens, cache_salt="A")
    assert scheduler.num_new_matched_tokens(request, 0) == (64, False)
    scheduler.after_alloc(request, [20, 21, 22, 23, 24], 64)
    out = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id="a",
                prompt_token_ids=tokens,
                block_ids=([20, 21, 22, 23, 24],),
                num_computed_tokens=64,
            )
        ],
        num_scheduled_tokens={"a": 16},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    meta = scheduler.build_meta(out)
    assert [(s.request_id, s.cache_salt) for s in meta.loads] == [("a", "A")]
    worker.load(meta)
    for layer in worker.paged.layers:
        assert torch.equal(layer[[20, 21, 22, 23]], layer[[3, 4, 5, 6]])
    for rid in ("a", "b", "none"):
        scheduler.finished(rid)
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    scheduler.close()


def test_a_load_that_fails_is_never_offered_again() -> None:
    """Redis holds the hit, then stops before the load: the load fails, and from then on
    the failed chunks are a miss for that request, on both sides: the scheduler offers
    nothing when vLLM asks again, and a new lookup of it on the worker finds nothing."""
    from tests.redis_servers import RedisServer

    redis = RedisServer().start()
    try:
        tokens = list(range(700, 780))
        first = make_worker(remote_url=redis.url)
        fill(first, [3, 4, 5, 6], seed=12)
        first.save(KVTierMetadata(saves=[SaveSpec("w", tokens[:64], [3, 4, 5, 6], 0, 64)]))
        first.close()  # drains the Redis writes
        second = make_worker(remote_url=redis.url)  # CPU empty: the hit is in Redis only
        scheduler = SchedulerSide(
            [LookupClient(second.engine_id)],
            block_size=BLOCK,
            chunk_size=CHUNK,
            loads=True,
            saves=True,
        )
        try:
            request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
            assert scheduler.num_new_matched_tokens(request, 0) == (64, True)
            scheduler.after_alloc(request, [30, 31, 32, 33, 34], 64)
            redis.stop()  # mid-load: after the lookup promised it, before the read
            out = SimpleNamespace(
                preempted_req_ids=None,
                scheduled_new_reqs=[],
                num_scheduled_tokens={},
                scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
            )
            second.load(scheduler.build_meta(out))
            deadline = time.monotonic() + 30
            while "r" not in second.finished_loads():
                assert time.monotonic() < deadline, "the failed load was never reported"
                time.sleep(0.01)
            assert second.failed_blocks() == {30, 31, 32, 33}
            scheduler.short_loads(second.short_loads())
            # vLLM reschedules the request from token 0 and asks again: nothing is offered
            assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
            assert second.engine is not None
            # The worker's lease remembers it too: with the chunks back (stored again, in
            # the CPU tier now), another request hits them and this one still does not.
            redis.start()
            fill(second, [3, 4, 5, 6], seed=12)
            second.save(KVTierMetadata(saves=[SaveSpec("w2", tokens[:64], [3, 4, 5, 6], 0, 64)]))
            probe = LookupClient(second.engine_id)
            assert probe.lookup("other", tokens) == Hit(64, 64)
            assert probe.lookup("r", tokens) == Hit(0, 0)
            probe.end("other")
            probe.close()
            scheduler.finished("r")
            assert second.engine.leaks() == [] and second.engine.check_invariants() == []
        finally:
            scheduler.close()
            second.close()
    finally:
        redis.cleanup()


def test_one_request_is_hashed_once_through_lookup_load_save_and_end(worker: WorkerSide) -> None:
    """The prompt's chunks are hashed by its lookup and by nothing after it: the load reuses
    the plan the lease pinned, the save of its new chunks and their events reuse the keys
    kept with the lease, the end hashes nothing (before: lookup, CPU share, load, store and
    events each hashed the prompt again)."""
    assert worker.engine is not None
    chain = worker.engine.keychain
    tokens = list(range(2000, 2000 + 4 * CHUNK + 8))  # 4 whole chunks + 8
    fill(worker, [1, 2, 3, 4], seed=13)
    worker.save(KVTierMetadata(saves=[SaveSpec("w", tokens[:64], [1, 2, 3, 4], 0, 64)]))
    worker.take_events()
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    before = chain.chunks_hashed
    request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
    assert scheduler.num_new_matched_tokens(request, 0) == (64, False)
    assert chain.chunks_hashed - before == 4  # the lookup: each whole chunk, once
    dst = list(range(20, 29))
    scheduler.after_alloc(request, dst, 64)
    out = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id="r", prompt_token_ids=tokens, block_ids=(dst,), num_computed_tokens=64
            )
        ],
        num_scheduled_tokens={"r": len(tokens) - 64},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    meta = scheduler.build_meta(out)
    assert [(s.start, s.end) for s in meta.loads] == [(0, 64)]
    assert [(s.start, s.end) for s in meta.saves] == [(64, 128)]
    worker.load(meta)
    worker.save(meta)
    assert worker.failed_blocks() == set()
    stored = [e for e in worker.take_events() if e[0] == "stored"]
    # chunks 2 and 3, one event in vLLM-sized blocks, named from the lease's keys
    assert [len(e[1]) for e in stored] == [2 * CHUNK // BLOCK]
    scheduler.finished("r")
    assert chain.chunks_hashed - before == 4  # load, save, events and end: no hash
    assert worker.engine.stats()["stored_chunks"] == 4
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    scheduler.close()


def test_two_kv_cache_groups_save_and_load_by_their_own_block_tables() -> None:
    """vLLM's hybrid manager (SupportsHMA): layer 0 in a sliding-window group, layer 1 in a
    full-attention group, each with its own block table. Saves read each layer through its
    group's table; loads are asynchronous (vLLM takes failures per request for such models)
    and never write the sliding group's null block (id 0)."""
    from kvtier.layout import GroupKind

    names = list(kv_caches())
    groups = ModelGroups(
        (
            VllmGroup(GroupKind.SLIDING, BLOCK, (names[0],), "SlidingWindowSpec"),
            VllmGroup(GroupKind.FULL, 0, (names[1],), "FullAttentionSpec"),
        )
    )
    side = make_worker(model_name="tiny-hybrid", groups=groups)
    try:
        assert side.paged is not None and side.engine is not None
        # The sliding group keeps the window in whole blocks plus one block of each chunk.
        assert side.engine.layout.describe_groups() == f"sliding/w{BLOCK}/k{2 * BLOCK}:0;full:1"
        sliding, full = side.paged.layers
        gen = torch.Generator().manual_seed(5)
        for layer in (sliding, full):
            layer[1:] = torch.randn(BLOCKS - 1, HEADS, BLOCK, 2 * DIM, generator=gen)
        tokens = list(range(500, 580))
        src = ([3, 4, 5, 6], [7, 8, 9, 10])
        side.save(
            KVTierMetadata(saves=[SaveSpec("r1", tokens[:64], src[0], 0, 64, group_block_ids=src)])
        )
        # A range the sliding group no longer holds (null block) is not stored at all.
        side.save(
            KVTierMetadata(
                saves=[
                    SaveSpec(
                        "r0",
                        list(range(900, 932)),
                        [0, 11],
                        0,
                        32,
                        group_block_ids=([0, 11], [12, 13]),
                    )
                ]
            )
        )
        assert side.engine.stats()["stored_chunks"] == 2

        scheduler = SchedulerSide(
            [LookupClient(side.engine_id)],
            block_size=BLOCK,
            chunk_size=CHUNK,
            loads=True,
            saves=True,
            all_async=True,
        )
        request = SimpleNamespace(request_id="r2", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 0) == (64, True)  # CPU, yet async
        dst = ([0, 0, 22, 23, 24], [30, 31, 32, 33, 34])  # sliding: first blocks dropped
        null_before = sliding[0].clone()
        scheduler.after_alloc(request, dst[0], 64, dst)
        meta = scheduler.build_meta(
            SimpleNamespace(
                preempted_req_ids=set(),
                scheduled_new_reqs=[],
                num_scheduled_tokens={},
                scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
            )
        )
        (spec,) = meta.loads
        assert spec.async_load and spec.group_block_ids == dst
        side.load(meta)
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = side.finished_loads()
            time.sleep(0.01)
        assert done == {"r2"} and side.failed_requests(done) == set()
        assert torch.equal(full[dst[1][:4]], full[src[1]])  # full group: every token
        assert torch.equal(sliding[dst[0][2:4]], sliding[src[0][2:4]])  # in the window
        assert torch.equal(sliding[0], null_before)  # the null block is never written
        scheduler.finished("r2")
        assert side.engine.leaks() == [] and side.engine.check_invariants() == []
        scheduler.close()
    finally:
        side.close()


def _image_request(rid: str, tokens: list[int], image: str | None) -> SimpleNamespace:
    """A request as vLLM's scheduler gives it, with ``image`` over tokens [40, 50)."""
    position = SimpleNamespace(offset=40, length=10)
    features = [] if image is None else [SimpleNamespace(identifier=image, mm_position=position)]
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        cache_salt=None,
        lora_request=None,
        mm_features=features,
        prompt_embeds=None,
    )


def _first_step(rid: str, tokens: list[int], blocks: list[int]) -> SimpleNamespace:
    """vLLM's SchedulerOutput for the step that computes all of a new request's prompt."""
    new = SimpleNamespace(
        req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[new],
        num_scheduled_tokens={rid: len(tokens)},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


def test_an_image_keys_the_chunks_from_its_own_on_and_its_events_stop_before_it(
    worker: WorkerSide,
) -> None:
    """Same tokens, another image: only the chunk before the image is shared (with text-only
    requests too, as in vLLM); the image's own requests hit it all. The router matches events
    by tokens alone, so the chunk holding the image is not published."""
    assert worker.engine is not None and worker.paged is not None
    tokens = list(range(400, 480))  # 2 whole chunks; the image sits in chunk 1
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    first = _image_request("a", tokens, "image-1")
    assert scheduler.num_new_matched_tokens(first, 0) == (0, False)
    scheduler.after_alloc(first, [3, 4, 5, 6, 7], 0)
    fill(worker, [3, 4, 5, 6], seed=13)
    worker.save(scheduler.build_meta(_first_step("a", tokens, [3, 4, 5, 6, 7])))
    stored = [name for e in worker.take_events() if e[0] == "stored" for name in e[1]]
    plain = worker.engine.keychain.keys(tokens, include_partial=False).keys
    assert stored == block_names(plain[0], CHUNK // BLOCK)  # chunk 0 only: it is plain text
    cases = [("other", "image-2", 32), ("text", None, 32), ("same", "image-1", 64)]
    for rid, image, hit in cases:
        assert scheduler.num_new_matched_tokens(_image_request(rid, tokens, image), 0) == (
            hit,
            False,
        ), rid
    for rid in ("a", "other", "text", "same"):
        scheduler.finished(rid)
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    scheduler.close()


def test_a_request_with_an_extra_key_kvtier_does_not_know_is_not_cached(
    worker: WorkerSide,
) -> None:
    """Fail closed: a kind of extra key a future vLLM adds is never keyed by tokens alone;
    the request is neither looked up nor saved, and counted."""
    from kvtier.integrations.vllm.extra_keys import RequestKeyer

    tokens = list(range(500, 580))
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    scheduler._keyer = RequestKeyer(CHUNK, lambda r, s, e, i: ((("future", "x"),), i))
    request = _image_request("f", tokens, "image-1")  # has an image: the keyer is asked
    assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.uncached == 1
    scheduler.after_alloc(request, [3, 4, 5, 6, 7], 0)
    meta = scheduler.build_meta(_first_step("f", tokens, [3, 4, 5, 6, 7]))
    assert meta.saves == [] and meta.loads == []
    scheduler.finished("f")
    assert worker.engine is not None and worker.engine.stats()["lookups"] == 0
    scheduler.close()


def test_a_misspelt_key_in_vllms_extra_config_is_refused_naming_where_it_came_from() -> None:
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.connector import load_config

    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.*max_local_cpu_size"):
        load_config({"kvtier.max_local_cpu_sise": "2GiB"})


def step_of_new(rid: str, tokens: list[int], blocks: list[int], scheduled: int) -> SimpleNamespace:
    """vLLM's SchedulerOutput for one new request prefilling ``scheduled`` tokens."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0
            )
        ],
        num_scheduled_tokens={rid: scheduled},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


IDLE_STEP = SimpleNamespace(
    preempted_req_ids=set(),
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
)


@pytest.mark.parametrize("save_decode", [True, False])
def test_an_ended_requests_answer_is_saved_before_vllm_frees_its_blocks(
    worker: WorkerSide, save_decode: bool
) -> None:
    """A chat's next turn sends the answer back: with save_decode, the whole chunks of
    prompt + output past the prompt's own are saved in the step after the request ends,
    vLLM keeps the blocks until the worker reports that step (finished_sending), and the
    next turn's prompt hits them. The last sampled token has no KV: never in a chunk."""
    assert worker.engine is not None and worker.paged is not None
    prompt, answer = list(range(5000, 5040)), list(range(7000, 7039))  # 40 + 39 tokens
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)],
        block_size=BLOCK,
        chunk_size=CHUNK,
        loads=True,
        saves=True,
        save_decode=save_decode,
    )
    request = SimpleNamespace(request_id="t1", prompt_token_ids=prompt, kv_transfer_params=None)
    assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
    blocks = [40, 41, 42, 43, 44]
    fill(worker, blocks, seed=17)
    scheduler.after_alloc(request, blocks, 0)
    meta = scheduler.build_meta(step_of_new("t1", prompt, blocks, len(prompt)))
    assert [(s.start, s.end) for s in meta.saves] == [(0, CHUNK)] and meta.finishing == []
    worker.save(meta)
    # decoded 39 tokens: 40 + 39 = 79 tokens, 78 of them with KV (the last was just sampled)
    ended = SimpleNamespace(
        request_id="t1",
        output_token_ids=answer,
        num_computed_tokens=len(prompt) + len(answer) - 1,
        num_in_flight_tokens=0,
    )
    assert scheduler.save_output(ended, (blocks,)) is save_decode
    scheduler.finished("t1")
    meta = scheduler.build_meta(IDLE_STEP)
    worker.save(meta)
    conversation = prompt + answer
    if not save_decode:
        assert meta.saves == [] and meta.finishing == [] and worker.finished_saves() == set()
        assert worker.engine.lookup(conversation + [1], "t2").tokens == CHUNK
        return
    assert [(s.start, s.end, len(s.tokens)) for s in meta.saves] == [(CHUNK, 2 * CHUNK, 64)]
    assert meta.finishing == ["t1"]
    assert worker.finished_saves() == {"t1"} and worker.finished_saves() == set()  # once
    # the next turn (prompt, answer, a new question) finds both chunks
    assert worker.engine.lookup(conversation + [1, 2, 3], "t2").tokens == 2 * CHUNK
    stored = torch.zeros(worker.engine.layout.kv_shape(2 * CHUNK))
    assert worker.engine.retrieve_into(conversation[: 2 * CHUNK], "t2", stored) == 2 * CHUNK
    worker.engine.end_request("t2")
    gathered = torch.zeros_like(stored)
    worker.paged.gather(blocks, 0, 2 * CHUNK, gathered)
    assert torch.equal(stored, gathered)
    assert scheduler.build_meta(IDLE_STEP).saves == []  # queued once
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    scheduler.close()


def test_no_answer_is_saved_where_its_keys_or_blocks_cannot_be_trusted(worker: WorkerSide) -> None:
    """A PD prefiller, a state model, a request kvtier does not cache, and one whose
    images key its prompt's chunks: nothing queued, vLLM frees at once."""
    prompt = list(range(40))
    ended = SimpleNamespace(
        request_id="x", output_token_ids=list(range(60)), num_computed_tokens=99
    )
    client = [LookupClient(worker.engine_id)]
    for kind in ("pd", "state", "uncached", "image"):
        scheduler = SchedulerSide(
            client,
            block_size=BLOCK,
            chunk_size=CHUNK,
            loads=True,
            saves=True,
            save_decode=True,
            pd_sender="p" if kind == "pd" else None,
            state_chunks=kind == "state",
        )
        request = SimpleNamespace(request_id="x", prompt_token_ids=prompt, kv_transfer_params=None)
        state = scheduler._state_of(request)
        if kind == "uncached":
            state.uncached = "an extra key kvtier does not know"
        if kind == "image":
            state.salt = ExtraKeys(items=((0, 8, b"\x01" * 16),))
        assert scheduler.save_output(ended, ([1, 2, 3, 4, 5, 6, 7],)) is False, kind
        assert scheduler.build_meta(IDLE_STEP).finishing == []
        scheduler.close()
