"""xPyD's hand-off on the connector's two sides, without vLLM's processes: two prefillers that
name no decoder (they hold what they compute and answer their PD address) and two decoders;
any decoder pulls what any prefiller holds, from the address in the answer, before its lookup
(answering None to vLLM meanwhile). Real Engines, real sockets, real paged tensors.
The whole path with vLLM and vllm-router runs in test_pd_router.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.handoff import PULL_TIMEOUT_S, Handoff
from kvtier.integrations.vllm.worker import WorkerSide

from .test_pd_handoff import ROUTER_PREFILL, TOKENS, pd_used, request, scheduler, step
from .worker_helpers import CHUNK, CHUNK_BYTES, fill, make_worker


@pytest.fixture
def fleet() -> Iterator[tuple[list[WorkerSide], list[WorkerSide]]]:
    prefillers = [
        make_worker(enable_pd=True, pd_role="sender", pd_buffer_size=f"{4 * CHUNK_BYTES}B")
        for _ in range(2)
    ]
    decoders = [
        make_worker(enable_pd=True, pd_role="receiver", pd_buffer_size=f"{4 * CHUNK_BYTES}B")
        for _ in range(2)
    ]
    yield prefillers, decoders
    for worker in prefillers + decoders:
        worker.close()


def source_used(worker: WorkerSide) -> int:
    stats = worker._pd.stats() if worker._pd is not None else None
    assert stats is not None
    return int(stats["used_bytes"])


def freed(prefiller: WorkerSide) -> bool:
    """The send buffer is empty, within a second (its serving thread ends a transfer right
    after the decoder's last reply)."""
    deadline = time.monotonic() + 1.0
    while source_used(prefiller) and time.monotonic() < deadline:
        time.sleep(0.01)
    return source_used(prefiller) == 0


def prefill(prefiller: WorkerSide, rid: str, seed: int, **params: Any) -> dict[str, Any]:
    """The prefiller's side of one request: the router's prefill, one step, its answer."""
    side = scheduler(prefiller, loads=True, saves=True, pd_sender=f"p-{rid}")
    src = [3, 4, 5, 6, 7]
    fill(prefiller, src, seed=seed)
    side.num_new_matched_tokens(request(rid, dict(ROUTER_PREFILL)), 0)  # its own cache: any
    side.after_alloc(request(rid, None), src, 0)
    prefiller.save(step(side, rid, src, 0, len(TOKENS)))
    answer = side.finished(rid, ROUTER_PREFILL)
    side.close()
    assert answer is not None
    return answer | params


def decode(decoder: WorkerSide, rid: str, answer: dict[str, Any]) -> int | None:
    """The decoder's lookup, asked again as vLLM does while it answers None."""
    side = scheduler(decoder, loads=True, saves=False)
    deadline = time.monotonic() + 10
    polls = 0
    while True:
        new, _ = side.num_new_matched_tokens(request(rid, answer), 0)
        if new is not None or time.monotonic() > deadline:
            break
        polls += 1
        time.sleep(0.01)
    assert side.finished(rid, answer) is None
    side.close()
    return new


def test_any_decoder_pulls_what_any_prefiller_held(
    fleet: tuple[list[WorkerSide], list[WorkerSide]],
) -> None:
    prefillers, decoders = fleet
    for i, (p, d) in enumerate([(0, 1), (1, 0), (1, 1), (0, 0)]):
        answer = prefill(prefillers[p], f"r{i}", seed=i)
        port = prefillers[p]._pd.stats()["port"]  # type: ignore[union-attr]
        assert answer["remote_host"] == "127.0.0.1" and answer["remote_port"] == port
        assert source_used(prefillers[p]) == 2 * CHUNK_BYTES  # held, waiting for a decoder
        assert decode(decoders[d], f"d{i}", answer) == 2 * CHUNK  # loadable: 2 whole chunks
        assert freed(prefillers[p])  # served once, freed
        assert pd_used(decoders[d]) == 0  # the decode request ended: its buffer is free
    for worker in decoders:
        assert worker.engine is not None
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    for worker in prefillers:
        assert worker._pd is not None and worker._pd.check() == []


def test_what_the_decoder_pulled_is_the_prefillers_kv(
    fleet: tuple[list[WorkerSide], list[WorkerSide]],
) -> None:
    prefillers, decoders = fleet
    prefiller, decoder = prefillers[0], decoders[1]
    assert prefiller.paged is not None and decoder.paged is not None
    answer = prefill(prefiller, "kv", seed=7)
    side = scheduler(decoder, loads=True, saves=False)
    dst = [20, 21, 22, 23, 24]
    while (hit := side.num_new_matched_tokens(request("dkv", answer), 0))[0] is None:
        time.sleep(0.01)
    assert hit == (64, True)
    side.after_alloc(request("dkv", answer), dst, 64)
    none = SimpleNamespace(
        preempted_req_ids=None,
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    decoder.load(side.build_meta(none))
    deadline = time.monotonic() + 10
    while "dkv" not in decoder.finished_loads() and time.monotonic() < deadline:
        time.sleep(0.01)
    for p_layer, d_layer in zip(prefiller.paged.layers, decoder.paged.layers, strict=True):
        assert torch.equal(d_layer[dst[:4]], p_layer[[3, 4, 5, 6]])
    side.finished("dkv", answer)
    side.close()
    assert pd_used(decoder) == 0


def test_a_dead_or_wrong_prefiller_means_the_decoder_prefills_at_once(
    fleet: tuple[list[WorkerSide], list[WorkerSide]],
) -> None:
    prefillers, decoders = fleet
    answer = prefill(prefillers[0], "gone", seed=1)
    prefillers[0].close()  # the prefiller dies before its decoder comes
    started = time.monotonic()
    assert decode(decoders[0], "d-gone", answer) == 0
    assert time.monotonic() - started < 5
    # Another prompt's transfer id (a salt, a different prompt): refused, nothing loaded.
    answer = prefill(prefillers[1], "salted", seed=2)
    salted = dict(answer)
    other = request("d-other", salted)
    other.prompt_token_ids = [t + 1 for t in TOKENS]
    side = scheduler(decoders[1], loads=True, saves=False)
    while (hit := side.num_new_matched_tokens(other, 0))[0] is None:
        time.sleep(0.01)
    assert hit == (0, False)
    side.finished("d-other", salted)
    assert source_used(prefillers[1]) == 2 * CHUNK_BYTES  # still there for its own decoder
    # (on the other decoder: this one remembers the id as ended, and refuses it from now on)
    assert decode(decoders[0], "d-salted", answer) == 2 * CHUNK
    assert freed(prefillers[1])
    side.close()
    for worker in decoders:
        assert pd_used(worker) == 0
        assert worker.engine is not None and worker.engine.leaks() == []


def test_bad_addresses_in_the_params_are_ignored_never_dialed() -> None:
    handoff = Handoff([], pd_sender=None, loads=True, complaints=_quiet())
    assert PULL_TIMEOUT_S > 0
    for host, port in (("", 80), ("h", 0), ("h", "80"), (7, 80), ("h" * 300, 80)):
        params = {"kvtier_transfer_id": "t", "remote_host": host, "remote_port": port}
        assert handoff.transfer(params) == ("t", None)
    params = {"kvtier_transfer_id": "t", "remote_host": "h", "remote_port": 9}
    tid, source = handoff.transfer(params | {"kvtier_remote_ports": [9, 10]})
    assert tid == "t" and source is not None and (source.port(0), source.port(1)) == (9, 10)


def _quiet() -> Any:
    import logging

    from kvtier.repeated_log import RepeatedLog

    return RepeatedLog(logging.getLogger("test"))
