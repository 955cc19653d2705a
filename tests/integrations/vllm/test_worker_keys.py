"""What keys a request's chunks and what vLLM is told about them, with a real Engine and real
paged tensors: KV events for stores and evictions, counter deltas, and the keys that a
cache_salt, an image or an unknown extra key gives a request."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.events import block_names, to_vllm
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.worker_helpers import (
    BLOCK,
    CHUNK,
    fill,
    first_step,
    image_request,
    scheduler_for,
)
from tests.integrations.vllm.worker_helpers import worker as worker  # a fixture


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
    scheduler = scheduler_for(worker)
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


def test_an_image_keys_the_chunks_from_its_own_on_and_its_events_stop_before_it(
    worker: WorkerSide,
) -> None:
    """Same tokens, another image: only the chunk before the image is shared (with text-only
    requests too, as in vLLM); the image's own requests hit it all. The router matches events
    by tokens alone, so the chunk holding the image is not published."""
    assert worker.engine is not None and worker.paged is not None
    tokens = list(range(400, 480))  # 2 whole chunks; the image sits in chunk 1
    scheduler = scheduler_for(worker)
    first = image_request("a", tokens, "image-1")
    assert scheduler.num_new_matched_tokens(first, 0) == (0, False)
    scheduler.after_alloc(first, [3, 4, 5, 6, 7], 0)
    fill(worker, [3, 4, 5, 6], seed=13)
    worker.save(scheduler.build_meta(first_step("a", tokens, [3, 4, 5, 6, 7])))
    stored = [name for e in worker.take_events() if e[0] == "stored" for name in e[1]]
    plain = worker.engine.keychain.keys(tokens, include_partial=False).keys
    assert stored == block_names(plain[0], CHUNK // BLOCK)  # chunk 0 only: it is plain text
    cases = [("other", "image-2", 32), ("text", None, 32), ("same", "image-1", 64)]
    for rid, image, hit in cases:
        assert scheduler.num_new_matched_tokens(image_request(rid, tokens, image), 0) == (
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
    scheduler = scheduler_for(worker)
    scheduler._keyer = RequestKeyer(CHUNK, lambda r, s, e, i: ((("future", "x"),), i))
    request = image_request("f", tokens, "image-1")  # has an image: the keyer is asked
    assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.uncached == 1
    scheduler.after_alloc(request, [3, 4, 5, 6, 7], 0)
    meta = scheduler.build_meta(first_step("f", tokens, [3, 4, 5, 6, 7]))
    assert meta.saves == [] and meta.loads == []
    scheduler.finished("f")
    assert worker.engine is not None and worker.engine.stats()["lookups"] == 0
    scheduler.close()
