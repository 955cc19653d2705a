"""Two real processes over loopback: a prefiller (spawned) and this decoder.

500 requests sharing prefixes, with random aborts and a few oversized prompts, through a
buffer of 6 chunks; every answer equals a local prefill; afterwards the buffer is entirely
free and nothing is pinned. Then a sender killed with SIGKILL mid-transfer.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.errors import TransferError
from tests.pd.pd_helpers import (
    CHANNELS,
    NIXL,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    pd_tier,
    request_tokens,
    run_sender,
    run_sender_stalled_after,
    run_stalling_sender,
    send_one,
    sender,
)

SPAWN = multiprocessing.get_context("spawn")  # forking after torch is imported can hang


@pytest.fixture
def processes() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    procs: list[multiprocessing.process.BaseProcess] = []
    yield procs
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)


@pytest.mark.parametrize(
    "channel, count",
    [("tcp", 500), ("shm", 100), pytest.param(*NIXL.values, 100, marks=NIXL.marks)],
)
def test_many_requests_from_another_process_leave_nothing_behind(
    processes: list[multiprocessing.process.BaseProcess], channel: str, count: int
) -> None:
    engine, receiver = decoder(channel, pages=6, timeout=5.0)
    try:
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=run_sender, args=(channel, receiver.port, count, 11, results))
        processes.append(proc)
        proc.start()
        arrived = 0
        for i in range(count):
            rid, tokens = f"r{i}", request_tokens(i, 11)
            outcome = receiver.wait_outcome(rid, 60.0)
            assert outcome is not None, f"{rid}: no transfer outcome"
            with engine.request(rid):
                kv = engine.retrieve(tokens, rid)
                hit = kv.shape[2]
                if outcome.ok:
                    assert hit == len(tokens), rid
                    arrived += 1
                # Identical to local generation: what arrived, plus the local rest.
                assert torch.equal(kv, fake_prefill(tokens)[:, :, :hit]), rid
        sent = dict(results.get(timeout=60.0) for _ in range(count + 1))
        proc.join(30.0)
        assert proc.exitcode == 0
        assert sum(1 for v in sent.values() if v == "ok") == arrived
        assert sum(1 for k, v in sent.items() if k != "done" and v != "ok") >= count // 50
        assert arrived >= count // 2
        assert pd_tier(engine).counters.stored > 0
        assert_all_free(engine)
    finally:
        receiver.close()
        engine.close()


@pytest.mark.parametrize("channel", CHANNELS)
def test_sigkilled_sender_gives_its_reservation_back(
    processes: list[multiprocessing.process.BaseProcess], channel: str
) -> None:
    engine, receiver = decoder(channel, pages=4)
    try:
        ready = SPAWN.Event()
        proc = SPAWN.Process(target=run_stalling_sender, args=(channel, receiver.port, ready))
        processes.append(proc)
        proc.start()
        assert ready.wait(60.0), "the stalling sender never got its reservation"
        tier = pd_tier(engine)
        assert tier.pool.free_pages < tier.num_pages  # mid-transfer: pages reserved
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        outcome = receiver.wait_outcome("doomed", 10.0)
        assert outcome is not None and not outcome.ok
        assert tier.pool.free_pages == tier.num_pages  # reclaimed before the request ends
        engine.end_request("doomed")
        tokens = request_tokens(2)
        with sender(channel, receiver.port) as tx:  # and the decoder keeps serving
            send_one(tx, "after", tokens)
        assert receiver.wait_outcome("after", 10.0) is not None
        with engine.request("after"):
            assert engine.lookup(tokens, "after").tokens == len(tokens)
        assert_all_free(engine)
    finally:
        receiver.close()
        engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_a_sender_killed_after_some_chunks_leaves_a_serving_decoder(
    processes: list[multiprocessing.process.BaseProcess], channel: str
) -> None:
    """The PD kill of the vLLM test, made deterministic: the sender process is SIGKILLed
    after exactly 3 of its 12 chunks arrived whole and mid-way through the 4th, while a
    decoder request has already looked up (and pinned) the 3 that arrived. The decoder
    learns the failure, serves those 3 chunks byte for byte, frees every page once its
    requests end, and the next transfer succeeds."""
    engine, receiver = decoder(channel, pages=12)
    try:
        ready = SPAWN.Event()
        proc = SPAWN.Process(
            target=run_sender_stalled_after, args=(channel, receiver.port, 3, ready)
        )
        processes.append(proc)
        proc.start()
        assert ready.wait(60.0), "the sender never got its reservation"
        tier = pd_tier(engine)
        tokens = request_tokens(49, 7)
        arrived = 3 * engine.config.chunk_size
        keys = [s.key for s in keychain().keys(tokens, include_partial=True)]
        deadline = time.monotonic() + 30.0
        while tier.contains(keys[:3]) != [True] * 3:  # the receiver takes in what was sent
            assert time.monotonic() < deadline, "the first 3 chunks never became visible"
            time.sleep(0.01)
        # Where the kill lands: 12 pages reserved, 3 chunks verified and visible, no outcome.
        assert tier.contains(keys[3:4]) == [False]
        assert tier.pool.free_pages == 0 and receiver.wait_outcome("doomed", 0.0) is None
        assert engine.lookup(tokens, "decode").tokens == arrived
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        outcome = receiver.wait_outcome("doomed", 10.0)
        assert outcome is not None and not outcome.ok and outcome.chunks == 3
        assert tier.pool.free_pages == tier.num_pages - 3  # only the decoder's pins remain
        kv = engine.retrieve(tokens, "decode")
        assert kv.shape[2] == arrived and torch.equal(kv, fake_prefill(tokens)[:, :, :arrived])
        engine.end_request("decode")
        engine.end_request("doomed")
        assert_all_free(engine)
        after = request_tokens(2)
        with sender(channel, receiver.port) as tx:  # the decoder keeps serving
            send_one(tx, "after", after)
        done = receiver.wait_outcome("after", 10.0)
        assert done is not None and done.ok
        with engine.request("after"):
            assert engine.lookup(after, "after").tokens == len(after)
        engine.end_request("after")
        assert_all_free(engine)
    finally:
        receiver.close()
        engine.close()


def test_a_closed_receiver_fails_the_next_send_cleanly() -> None:
    engine, receiver = decoder("tcp", pages=4)
    try:
        with sender("tcp", receiver.port) as tx:
            send_one(tx, "a", request_tokens(0))
            receiver.close()
            with pytest.raises(TransferError):
                send_one(tx, "b", request_tokens(1))
    finally:
        receiver.close()
        engine.close()
