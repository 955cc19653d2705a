"""PD's hand-off through vLLM's ``kv_transfer_params``, as the standard proxies (vllm-router,
vLLM's example proxies) carry it, on the connector's two sides with real Engines, a real PD
receiver on loopback and real paged tensors, without vLLM's processes:

    prefill request  {"do_remote_decode": true, "remote_*": null}   (what vllm-router sends)
    prefiller answer {"do_remote_prefill": true, "kvtier_transfer_id": ...} (request_finished)
    decode request   the answer, as it is

The whole path with vLLM and vllm-router runs in test_pd_router.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide

from .worker_helpers import BLOCK, CHUNK, CHUNK_BYTES, fill, make_worker

# What vllm-router 0.1.17 puts in the prefill request (observed on the wire).
ROUTER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TOKENS = list(range(100, 180))  # 80 tokens: 2 whole chunks (32) + 16


@pytest.fixture
def pair() -> Iterator[tuple[WorkerSide, WorkerSide]]:
    decoder = make_worker(enable_pd=True, pd_role="receiver", pd_buffer_size=f"{4 * CHUNK_BYTES}B")
    assert decoder.service is not None and decoder.service.receiver is not None
    port = decoder.service.receiver.port
    prefiller = make_worker(
        enable_pd=True, pd_role="sender", pd_peer_host="127.0.0.1", pd_peer_alloc_port=[port]
    )
    yield prefiller, decoder
    prefiller.close()
    decoder.close()


def scheduler(worker: WorkerSide, **roles: Any) -> SchedulerSide:
    return SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, **roles
    )


def request(rid: str, params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, kv_transfer_params=params)


def step(side: SchedulerSide, rid: str, blocks: list[int], computed: int, new: int) -> Any:
    """The metadata of the step that schedules ``new`` tokens of a new request ``rid``."""
    out = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=rid,
                prompt_token_ids=TOKENS,
                block_ids=(blocks,),
                num_computed_tokens=computed,
            )
        ],
        num_scheduled_tokens={rid: new},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    return side.build_meta(out)


def pd_used(worker: WorkerSide) -> int:
    client = LookupClient(worker.engine_id)
    try:
        return int(client.stats()["tiers"]["pd"]["used_bytes"])
    finally:
        client.close()


def test_the_prefillers_answer_is_what_the_decoder_loads_and_then_frees(
    pair: tuple[WorkerSide, WorkerSide],
) -> None:
    prefiller, decoder = pair
    assert prefiller.paged is not None and decoder.paged is not None
    p_side = scheduler(prefiller, loads=True, saves=True, pd_sender="prefiller-7")
    d_side = scheduler(decoder, loads=True, saves=False)
    src, dst = [3, 4, 5, 6, 7], [20, 21, 22, 23, 24]
    fill(prefiller, src, seed=1)

    # The prefiller: a miss; its step saves 2 whole chunks and sends them under a new id.
    assert p_side.num_new_matched_tokens(request("p1", dict(ROUTER_PREFILL)), 0) == (0, False)
    p_side.after_alloc(request("p1", None), src, 0)
    meta = step(p_side, "p1", src, 0, len(TOKENS))
    [save] = meta.saves
    assert (save.start, save.end) == (0, 64)
    assert save.transfer_id is not None and save.transfer_id.startswith("prefiller-7-")
    prefiller.save(meta)
    assert pd_used(decoder) == 2 * CHUNK_BYTES  # in the decoder's buffer before the answer
    answer = p_side.finished("p1", ROUTER_PREFILL)
    assert answer == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvtier_transfer_id": save.transfer_id,
    }

    # The decoder, with the answer as the proxy passes it on: 64 tokens from the PD tier,
    # loaded in the background (the request waits for them, the batch does not).
    assert d_side.num_new_matched_tokens(request("d1", answer), 0) == (64, True)
    d_side.after_alloc(request("d1", answer), dst, 64)
    meta = d_side.build_meta(
        SimpleNamespace(
            preempted_req_ids=None,
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        )
    )
    assert [(x.start, x.end, x.async_load) for x in meta.loads] == [(0, 64, True)]
    decoder.load(meta)
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while "d1" not in done and time.monotonic() < deadline:
        done |= decoder.finished_loads()
        time.sleep(0.01)
    assert done == {"d1"} and decoder.failed_blocks() == set()
    for p_layer, d_layer in zip(prefiller.paged.layers, decoder.paged.layers, strict=True):
        assert torch.equal(d_layer[dst[:4]], p_layer[src[:4]])
    assert decoder.short_loads() == {}
    assert d_side.finished("d1", answer) is None  # a decoder answers nothing
    assert pd_used(decoder) == 0  # both leases ended: the request's and the transfer's
    assert decoder.engine is not None and decoder.engine.leaks() == []
    assert decoder.engine.check_invariants() == []
    p_side.close()
    d_side.close()


def test_a_decode_request_refused_before_admission_frees_its_transfer_at_once(
    pair: tuple[WorkerSide, WorkerSide],
) -> None:
    """vLLM's API server submits a decode request it refused as already ended, so that the
    connector frees what its transfer holds: no lookup, no state, only request_finished."""
    prefiller, decoder = pair
    p_side = scheduler(prefiller, loads=False, saves=True, pd_sender="p")
    d_side = scheduler(decoder, loads=True, saves=False)
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=2)
    p_side.num_new_matched_tokens(request("p1", dict(ROUTER_PREFILL)), 0)
    p_side.after_alloc(request("p1", None), src, 0)
    prefiller.save(step(p_side, "p1", src, 0, len(TOKENS)))
    answer = p_side.finished("p1")
    assert answer is not None and pd_used(decoder) == 2 * CHUNK_BYTES
    d_side.finished("refused-1", answer)
    assert pd_used(decoder) == 0
    p_side.close()
    d_side.close()


def test_requests_outside_the_hand_off_send_nothing_and_answer_nothing(
    pair: tuple[WorkerSide, WorkerSide],
) -> None:
    prefiller, decoder = pair
    p_side = scheduler(prefiller, loads=True, saves=True, pd_sender="p")
    d_side = scheduler(decoder, loads=True, saves=False)
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=3)
    # A plain request to the prefiller (no do_remote_decode): cached, not sent.
    p_side.num_new_matched_tokens(request("plain", {"do_remote_decode": False}), 0)
    p_side.after_alloc(request("plain", None), src, 0)
    meta: KVTierMetadata = step(p_side, "plain", src, 0, len(TOKENS))
    assert [s.transfer_id for s in meta.saves] == [None]
    prefiller.save(meta)
    assert p_side.finished("plain") is None and pd_used(decoder) == 0
    # A prefiller's ids stay short whatever its engine id; a decoder ignores an id that is
    # not a short string (and the request prefills).
    long_side = scheduler(prefiller, loads=False, saves=True, pd_sender="e" * 500)
    long_side.num_new_matched_tokens(request("long", dict(ROUTER_PREFILL)), 0)
    long_answer = long_side.finished("long")
    assert long_answer is not None and len(long_answer["kvtier_transfer_id"]) == 64 + 1 + 32
    long_side.close()
    for bad in (7, "", "x" * 300, ["a"]):
        params = {"do_remote_prefill": True, "kvtier_transfer_id": bad}
        assert d_side.num_new_matched_tokens(request(f"d{bad!r:.8}", params), 0) == (0, False)
        d_side.finished(f"d{bad!r:.8}", params)
    p_side.close()
    d_side.close()


def test_a_decoder_never_takes_a_transfer_made_under_another_image(
    pair: tuple[WorkerSide, WorkerSide],
) -> None:
    """The prefiller computed the prompt with image 1; a decode request with the same tokens,
    the same transfer id and image 2 finds only the chunk before the image (plain text, the
    same KV) and prefills the rest itself."""
    prefiller, decoder = pair
    p_side = scheduler(prefiller, loads=True, saves=True, pd_sender="prefiller-8")
    d_side = scheduler(decoder, loads=True, saves=False)
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=2)

    def imaged(rid: str, params: dict[str, Any] | None, image: str) -> SimpleNamespace:
        position = SimpleNamespace(offset=40, length=10)  # in chunk 1
        return SimpleNamespace(
            **vars(request(rid, params)),
            cache_salt=None,
            lora_request=None,
            mm_features=[SimpleNamespace(identifier=image, mm_position=position)],
            prompt_embeds=None,
        )

    assert p_side.num_new_matched_tokens(imaged("p2", dict(ROUTER_PREFILL), "image-1"), 0) == (
        0,
        False,
    )
    p_side.after_alloc(imaged("p2", None, "image-1"), src, 0)
    prefiller.save(step(p_side, "p2", src, 0, len(TOKENS)))
    assert pd_used(decoder) == 2 * CHUNK_BYTES
    answer = p_side.finished("p2", ROUTER_PREFILL)
    assert answer is not None
    assert d_side.num_new_matched_tokens(imaged("d2", answer, "image-2"), 0) == (CHUNK, True)
    assert d_side.finished("d2", answer) is None
    assert pd_used(decoder) == 0  # the transfer's lease ended with the decode request
    assert decoder.engine is not None and decoder.engine.leaks() == []


def test_a_decoder_takes_a_transfer_only_under_the_adapter_it_was_made_with(
    pair: tuple[WorkerSide, WorkerSide], tmp_path: Path
) -> None:
    """LoRA through PD: the prefiller computed the prompt under adapter A (kvtier keys it by
    a digest of A's files). A decode request with the same tokens and transfer id under
    adapter B finds nothing (an adapter keys every chunk: B's KV differs from the first
    token), nor does one with no adapter; under A it loads the whole transfer."""
    prefiller, decoder = pair
    p_side = scheduler(prefiller, loads=True, saves=True, pd_sender="prefiller-9")
    d_side = scheduler(decoder, loads=True, saves=False)
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=3)
    adapters = {name: tmp_path / name for name in ("A", "B")}
    for seed, path in enumerate(adapters.values()):
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(bytes([seed + 1]) * 256)

    def adapted(rid: str, params: dict[str, Any] | None, name: str | None) -> SimpleNamespace:
        lora = None
        if name is not None:
            path = str(adapters[name])
            lora = SimpleNamespace(lora_name=name, lora_int_id=ord(name), lora_path=path)
        return SimpleNamespace(
            **vars(request(rid, params)),
            cache_salt=None,
            lora_request=lora,
            mm_features=[],
            prompt_embeds=None,
        )

    assert p_side.num_new_matched_tokens(adapted("p", dict(ROUTER_PREFILL), "A"), 0) == (0, False)
    p_side.after_alloc(adapted("p", None, "A"), src, 0)
    prefiller.save(step(p_side, "p", src, 0, len(TOKENS)))
    assert pd_used(decoder) == 2 * CHUNK_BYTES
    answer = p_side.finished("p", ROUTER_PREFILL)
    assert answer is not None
    for wrong in ("B", None):
        got = d_side.num_new_matched_tokens(adapted(f"d-{wrong}", answer, wrong), 0)
        assert got == (0, False), wrong
    assert d_side.num_new_matched_tokens(adapted("d-A", answer, "A"), 0) == (2 * CHUNK, True)
    for name in ("B", None, "A"):
        d_side.finished(f"d-{name}", answer)
    assert pd_used(decoder) == 0  # the transfer went with the requests that named it
    assert decoder.engine is not None and decoder.engine.leaks() == []
    p_side.close()
    d_side.close()


def test_a_state_models_prefiller_sends_its_hit_from_kvtiers_copy(
    pair: tuple[WorkerSide, WorkerSide],
) -> None:
    """A state model's vLLM keeps no state in its blocks at the chunk ends of a hit: the
    prefiller sends the hit's chunks once, read from kvtier (a ``held`` save at the request's
    first step), and the chunk it computes after them at that step's end, as always."""
    prefiller, decoder = pair
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=4)
    prefiller.save(KVTierMetadata(saves=[SaveSpec("w", TOKENS[:CHUNK], src, 0, CHUNK)]))
    side = scheduler(prefiller, loads=True, saves=True, pd_sender="p-state", state_chunks=True)
    assert side.num_new_matched_tokens(request("p", dict(ROUTER_PREFILL)), 0) == (CHUNK, False)
    side.after_alloc(request("p", None), src, CHUNK)
    meta = step(side, "p", src, CHUNK, CHUNK)  # the step after the hit ends on a chunk end
    assert [(s.start, s.end, s.from_cache) for s in meta.saves] == [(0, 32, True), (32, 64, False)]
    prefiller.load(meta)
    prefiller.save(meta)
    assert pd_used(decoder) == 2 * CHUNK_BYTES  # both chunks reached the decoder
    assert step(side, "p", src, 2 * CHUNK, 16).saves == []  # sent once
    assert side.finished("p", ROUTER_PREFILL) is not None
    assert prefiller.engine is not None and prefiller.engine.leaks() == []
    side.close()
