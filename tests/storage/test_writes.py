"""A lower-tier write keeps its chunk's CPU page until it lands (``WriteTicket``): what a
store hands the disk is neither free memory nor on disk before ``flush`` returns.

Found as a flaky vLLM test (``test_corrupt_and_deleted_disk_chunks_are_recomputed_once``: a
prompt recomputed and stored by one request came back ``cached 0`` for the next, and the
recomputing request logged no store). With 3 CPU pages, a request that starts while the
previous request's disk writes still run finds every page held by them: its disk hit is
declined (no page to read into) and its own store is dropped (no page to copy into), both as
documented (a store never waits). A loaded machine's slow fsync was enough; here the disk's
only writer thread is stalled by a put whose completion callback blocks, the same fault
deterministically. The vLLM tests now wait for ``flush`` between requests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.engine import Engine
from kvtier.hit import Hit
from kvtier.storage.base import PutJob, PutResult
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

C = SMALL_CHUNK
DOC = make_tokens(2 * C, seed=1)  # the prompt whose disk files are deleted (the vLLM "d")
OTHER = make_tokens(3 * C, seed=2)  # the request stored just before it (the vLLM "c1")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """3 CPU pages over a disk tier with one writer thread; DOC on disk only, its files
    deleted under the live index."""
    config = small_config(
        cpu_chunks=3,
        local_disk=str(tmp_path),
        max_local_disk_size="1MiB",
        extra_config={"disk_io_threads": 1},
    )
    engine = Engine(config, SMALL_LAYOUT, model_name="m").open()
    try:
        assert engine.store(DOC, make_kv(2 * C, 1)) == 2
        assert engine.flush(10.0)
        cpu = engine.tier("cpu")
        assert cpu is not None
        cpu.clear()  # DOC is on disk only
        for span in engine.request_keys(DOC).spans:
            (path,) = tmp_path.glob(f"*-{span.key.hex()}.kvc")
            path.unlink()
        yield engine
        assert engine.check_invariants() == []
    finally:
        engine.close()


class StalledWriter:
    """Blocks the disk tier's only writer thread in a put's completion callback (a write still
    in flight) until :meth:`release`: every write queued meanwhile waits behind it."""

    def __init__(self, engine: Engine) -> None:
        disk = engine.tier("disk")
        assert disk is not None
        self._gate = threading.Event()
        stuck = threading.Event()

        def blocked(_: PutResult) -> None:
            stuck.set()
            self._gate.wait(10.0)

        payload = torch.zeros(SMALL_LAYOUT.payload_bytes(C), dtype=torch.uint8)
        disk.put(PutJob(os.urandom(16), payload, C, "", blocked))
        assert stuck.wait(10.0)

    def release(self) -> None:
        self._gate.set()


def test_while_a_store_s_disk_writes_run_its_pages_are_not_free(engine: Engine) -> None:
    """What the flaky run saw: the request after OTHER is offered nothing (its hit cannot get a
    page) and stores nothing (its chunks cannot either), so the one after it misses too."""
    writer = StalledWriter(engine)
    try:
        assert engine.store(OTHER, make_kv(3 * C, 2)) == 3  # its 3 writes hold the 3 pages
        dropped = engine.stats()["dropped_chunks"]
        assert engine.lookup(DOC, "d1") == Hit(0, 0)  # declined: no page to read into
        engine.end_request("d1")
        assert engine.store(DOC, make_kv(2 * C, 1)) == 0  # the recompute: no page to copy into
        assert engine.stats()["dropped_chunks"] == dropped + 2
    finally:
        writer.release()
    assert engine.flush(10.0)


def test_once_flush_returns_the_next_request_loads_and_stores(engine: Engine) -> None:
    """The vLLM test's order as it now waits: OTHER's writes landed, DOC's hit is offered and
    tried (its files are gone: the load fails), the recompute is stored, and once that lands
    the next request finds DOC on disk."""
    writer = StalledWriter(engine)
    assert engine.store(OTHER, make_kv(3 * C, 2)) == 3
    writer.release()
    assert engine.flush(10.0)  # the completion signal: every write's page is back

    assert engine.lookup(DOC, "d1") == Hit(2 * C, 0)  # offered: the pages are free again
    out = torch.empty(SMALL_LAYOUT.kv_shape(2 * C), dtype=SMALL_LAYOUT.dtype)
    assert engine.retrieve_into(DOC, "d1", out) == 0  # the deleted files: recompute
    engine.end_request("d1")
    assert engine.store(DOC, make_kv(2 * C, 1)) == 2
    assert engine.flush(10.0)
    cpu = engine.tier("cpu")
    assert cpu is not None
    cpu.clear()  # as the vLLM test's next request pushes DOC out of the CPU tier

    assert engine.lookup(DOC, "d2") == Hit(2 * C, 0)
    assert engine.retrieve_into(DOC, "d2", out) == 2 * C
    assert torch.equal(out, make_kv(2 * C, 1))
    engine.end_request("d2")
