"""The worker's save hook with a real Engine and real paged tensors, without vLLM's processes:
what a step's saves store, by each KV-cache group's own block table, and the guard that saves
an ended request's answer before vLLM frees its blocks, and only where it can be trusted."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.request_salt import ExtraKeys
from tests.integrations.vllm.worker_helpers import (
    BLOCK,
    BLOCKS,
    CHUNK,
    DIM,
    HEADS,
    IDLE_STEP,
    fill,
    kv_caches,
    make_worker,
    scheduler_for,
    step_of_new,
)
from tests.integrations.vllm.worker_helpers import worker as worker  # a fixture


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

        scheduler = scheduler_for(side, all_async=True)
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
    scheduler = scheduler_for(worker, save_decode=save_decode)
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


def test_the_copy_buffer_holds_a_steps_chunks_not_the_prompt(worker: WorkerSide) -> None:
    """A prompt saved over several steps, then loaded by a request whose first chunks vLLM
    holds itself: the worker's buffer (GPU memory outside vLLM's budget on a GPU host) is
    sized by a step's chunks and by the load's own range, and the bytes still round trip."""
    assert worker.paged is not None and worker.engine is not None
    chunk, step = worker.engine.config.chunk_size, 2 * CHUNK
    prompt = 3 * step
    tokens = [7000 + t for t in range(prompt)]
    src = list(range(1, 1 + prompt // BLOCK))
    fill(worker, src, seed=4104)
    for start in range(0, prompt, step):
        worker.save(
            KVTierMetadata(saves=[SaveSpec("s", tokens[: start + step], src, start, start + step)])
        )
    assert worker.engine.stats()["stored_chunks"] == prompt // chunk
    assert worker.scratch_tokens == step  # the whole prompt's KV was never gathered at once

    local = 2 * step  # what vLLM's own prefix cache holds: not loaded, not given room
    client = LookupClient(worker.engine_id)
    assert client.lookup("l", tokens).tokens == prompt
    end = (prompt - 1) // BLOCK * BLOCK  # vLLM never takes the last token from a cache
    dst = list(range(40, 40 + prompt // BLOCK))
    worker.load(KVTierMetadata(loads=[LoadSpec("l", tokens, dst, local, end)]))
    assert worker.failed_blocks() == set() and worker.short_loads() == {}
    assert worker.scratch_tokens == prompt - local
    first, last = local // BLOCK, end // BLOCK
    for layer in worker.paged.layers:
        assert torch.equal(layer[dst[first:last]], layer[src[first:last]])
        assert not layer[dst[:first]].any()  # vLLM's own blocks are never written
    assert client.end("l") is True
    assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    client.close()
