"""The disk tier when its files or its directory misbehave: a FIFO under a chunk's name, a
read that never returns (a stuck network filesystem), the directory deleted while running,
and close() racing calls on other threads."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier import Engine
from kvtier.errors import StateError, TierUnavailable
from kvtier.storage.base import PutJob, PutOutcome
from kvtier.storage.disk import files
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.tier import DiskTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import wait_until
from tests.storage.disk.disk_helpers import FP, RECORD_BYTES
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    Outcomes,
    payload,
    put_and_wait,
    random_key,
)

TIMEOUT_S = 0.5
SLACK_S = 2.5  # scheduling margin on a busy 2-core machine


def open_tier(path: Path, timeout_s: float = TIMEOUT_S) -> DiskTier:
    tier = DiskTier(
        DiskOptions(str(path), 64 * RECORD_BYTES, 2, 64 * RECORD_BYTES, timeout_s),
        CONTRACT_LAYOUT,
        FP,
    )
    tier.open()
    return tier


def within(seconds: float, fn: Callable[[], object]) -> tuple[bool, object]:
    """Run ``fn`` on a thread; (finished in time, its result or exception)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive(), box[0] if box else None)


def chunk_path(path: Path, key: bytes) -> Path:
    return path / files.final_name(FP.hex(), key)


# -- a FIFO under a chunk's name -------------------------------------------------------------
def test_a_fifo_under_a_chunk_name_is_a_quick_miss_and_removed(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    key = random_key()
    fifo = chunk_path(tmp_path, key)
    try:
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
        fifo.unlink()
        os.mkfifo(fifo)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        finished, result = within(TIMEOUT_S + SLACK_S, lambda: tier.get_into(key, out))
        assert finished, "get_into blocked opening a FIFO"
        assert result is None
        assert tier.counters.corrupt == 1 and not fifo.exists()
        assert tier.contains([key]) == [False]
        finished, _ = within(TIMEOUT_S + SLACK_S, tier.close)
        assert finished, "close waited on a reader stuck on a FIFO"
    finally:
        if fifo.exists():  # release a reader the old code left blocked in open()
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        tier.close()


# -- a read that never returns -----------------------------------------------------------------
@pytest.fixture
def stuck_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Reads block until the event is set, as on a hung network filesystem (which this
    machine cannot mount: no NFS server, no FUSE library), and then write into their
    buffer, as a read finally returning would."""
    release = threading.Event()
    real = files.read_record_into

    def stuck(*args: object, **kwargs: object) -> object:
        release.wait(60)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "read_record_into", stuck)
    yield release
    release.set()


def test_a_stuck_read_is_a_miss_within_the_timeout_and_close_does_not_wait(
    tmp_path: Path, stuck_reads: threading.Event
) -> None:
    tier = open_tier(tmp_path)
    keys = [random_key() for _ in range(3)]
    for i, key in enumerate(keys):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    start = time.monotonic()
    finished, result = within(TIMEOUT_S + SLACK_S, lambda: tier.get_into(keys[0], out))
    assert finished, "a stuck read held get_into past the timeout"
    assert isinstance(result, TierUnavailable)  # ReadAbandoned: the page is still busy
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    # While it is stuck, every read misses at once instead of queueing behind it.
    many = [(k, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) for k in keys[1:]]
    finished, result = within(0.5, lambda: tier.get_many_into(many))
    assert finished and result == [None, None]
    tier.usage()  # refreshes the counters
    assert tier.counters.read_timeouts == 1
    finished, _ = within(TIMEOUT_S + SLACK_S + 1, tier.close)
    assert finished, "close waited on a stuck reader"
    stuck_reads.set()
    wait_until(
        lambda: not any(t.name.startswith("kvtier-disk-read") for t in threading.enumerate()),
        10,
        "the reader stuck past close to end once its read returns",
    )


def test_engine_keeps_the_page_of_a_stuck_read_until_it_returns(
    tmp_path: Path, stuck_reads: threading.Event
) -> None:
    config = small_config(
        local_disk=str(tmp_path),
        max_local_disk_size="1MiB",
        local_cpu=False,
        use_only_staging_buffer=True,
        blocking_timeout_secs=TIMEOUT_S,
    )
    tokens, kv = make_tokens(48, seed=5), make_kv(48, seed=5)
    with Engine(config, SMALL_LAYOUT, model_name="m") as engine:
        assert engine.store(tokens, kv) == 3
        assert engine.flush(10)
        free_before = engine.stats()["allocator"]["pages_free"]
        assert engine.lookup(tokens, "r").tokens == 48
        out = torch.zeros_like(kv)
        finished, loaded = within(
            TIMEOUT_S + SLACK_S, lambda: engine.retrieve_into(tokens, "r", out)
        )
        assert finished and loaded == 0  # every chunk a miss: the engine recomputes
        engine.end_request("r")
        # The stuck reads' pages stay allocated, owned as I/O in flight, not freed.
        assert engine.stats()["allocator"]["pages_free"] < free_before
        assert engine.check_invariants() == []
        stuck_reads.set()
        wait_until(
            lambda: engine.stats()["allocator"]["pages_free"] == free_before,
            10,
            "the stuck reads' pages to come back",
        )
        assert engine.check_invariants() == [] and engine.leaks() == []
        assert engine.lookup(tokens, "r2").tokens == 48
        assert torch.equal(engine.retrieve(tokens, "r2"), kv)
        engine.end_request("r2")


# -- the directory deleted while running ----------------------------------------------------
def test_a_deleted_directory_is_reported_dropped_and_recovered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cache"
    tier = open_tier(path)
    try:
        keys = [random_key() for _ in range(3)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        shutil.rmtree(path)
        # No stale hits: the index of the deleted directory is dropped.
        assert tier.contains(keys) == [False, False, False]
        assert tier.usage().entries == 0
        assert tier.counters.directory_lost == 1
        assert tier.counters.available == 0
        lost = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("was deleted" in m and str(path) in m for m in lost), lost
        result = put_and_wait(tier, keys[0], payload(CONTRACT_CHUNK, 0), CONTRACT_CHUNK)
        assert result.outcome in (PutOutcome.DROPPED, PutOutcome.FAILED)
        # Once the path is usable again (re-created by the tier, as open() does), writes
        # land in the new directory.
        wait_until(
            lambda: (
                put_and_wait(tier, keys[0], payload(CONTRACT_CHUNK, 0), CONTRACT_CHUNK).outcome
                is PutOutcome.STORED
            ),
            10,
            "a write to land in the re-created directory",
        )
        assert chunk_path(path, keys[0]).exists()
        assert tier.contains(keys) == [True, False, False]
        assert tier.counters.available == 1
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(keys[0], out) == CONTRACT_CHUNK
    finally:
        tier.close()


def test_files_put_back_in_a_recreated_directory_are_found(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    tier = open_tier(path)
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 4), CONTRACT_CHUNK)
        saved = tmp_path / "saved"
        shutil.copytree(path, saved)
        shutil.rmtree(path)
        assert tier.contains([key]) == [False]
        saved.rename(path)  # an operator restores the directory
        wait_until(lambda: tier.contains([key]) == [True], 10, "the restored chunk")
    finally:
        tier.close()


# -- close racing calls ------------------------------------------------------------------------
def _hammer(tier: DiskTier, keys: list[bytes], worker: int, done: Outcomes, log: list[str]) -> None:
    """Calls in a loop until the tier refuses one with StateError; anything else is logged.
    Every put is noted ("put") so the test can check each completed exactly once."""
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    many = [(k, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) for k in keys]
    calls: list[Callable[[], object]] = [
        lambda: tier.contains(keys),
        lambda: tier.get_into(keys[worker % len(keys)], out),
        lambda: tier.get_many_into(many),
        lambda: tier.pin(keys[0]),
        lambda: tier.unpin(keys[0]),
        lambda: tier.usage(),
    ]
    for n in range(10_000):
        try:
            calls[n % len(calls)]()
            if n % 7 == 0:
                log.append("put")
                tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, n), CONTRACT_CHUNK, "", done))
        except StateError:
            return
        except BaseException as exc:
            log.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
            return


def test_calls_racing_close_get_state_error_and_every_put_completes_once(tmp_path: Path) -> None:
    for round_ in range(10):
        tier = open_tier(tmp_path / f"r{round_}", timeout_s=5.0)
        keys = [random_key() for _ in range(4)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        done, log = Outcomes(), []
        workers = [
            threading.Thread(target=_hammer, args=(tier, keys, i, done, log)) for i in range(4)
        ]
        for worker in workers:
            worker.start()
        time.sleep(0.01 * (round_ % 3 + 1))
        tier.close()
        for worker in workers:
            worker.join(30)
        assert [e for e in log if e != "put"] == []
        puts = log.count("put")
        assert len(done.wait(puts, timeout=10)) == puts  # each exactly once
