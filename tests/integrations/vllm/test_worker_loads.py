"""The worker's load hook with a real Engine and real paged tensors, without vLLM's processes:
a lookup's hit loaded into vLLM's blocks, loads that come up short or fail, loads of ended
requests, and the hash a request pays once."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import Hit, LookupClient
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.worker_helpers import (
    BLOCK,
    CHUNK,
    CHUNK_BYTES,
    fill,
    make_worker,
    scheduler_for,
)
from tests.integrations.vllm.worker_helpers import worker as worker  # a fixture


def test_save_lookup_load_round_trip_through_the_socket(worker: WorkerSide) -> None:
    assert worker.paged is not None and worker.engine is not None
    tokens = list(range(100, 180))  # 80 tokens: 2 whole chunks + 16
    src = [3, 4, 5, 6, 7]
    fill(worker, src, seed=1)
    worker.save(KVTierMetadata(saves=[SaveSpec("r1", tokens[:64], src, 0, 64)]))

    scheduler = scheduler_for(worker)
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
        scheduler = scheduler_for(second)
        request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 0) == (64, True)
        in_step = scheduler_for(second, async_lower_loads=False)
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
        scheduler = scheduler_for(second)
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
    scheduler = scheduler_for(worker)
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
