"""``python -m benchmarks vllm``'s checks that kvtier served the runs it names, against a real
Engine over its real lookup socket (the worker side without vLLM's processes; the LLM handle
the bench reads its engine id from is the only stand-in). The bench itself runs three vLLM
instances, too slow for the suite; ``python -m benchmarks vllm --json`` exercises these checks."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from benchmarks.vllm import _drop_page_cache, _reset_prefix_cache, _served

from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.worker_helpers import fill, make_worker

LIBC = ctypes.CDLL(None, use_errno=True)
TOKENS = list(range(300, 370))  # 70 tokens: two whole 32-token chunks


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    side = make_worker()
    fill(side, [1, 2, 3, 4], seed=3)
    side.save(KVTierMetadata(saves=[SaveSpec("s", TOKENS[:64], [1, 2, 3, 4], 0, 64)]))
    yield side
    side.close()


def handle(worker: WorkerSide, reset: bool = True) -> SimpleNamespace:
    """What the bench reads from ``vllm.LLM``: the engine id, and reset_prefix_cache."""
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=worker.engine_id))
    return SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=config), reset_prefix_cache=lambda: reset
    )


def serve(worker: WorkerSide, rid: str) -> None:
    """What vLLM does for a request kvtier serves: lookup, load into its blocks, end."""
    client = LookupClient(worker.engine_id)
    try:
        assert client.lookup(rid, TOKENS).tokens == 64
        worker.load(KVTierMetadata(loads=[LoadSpec(rid, TOKENS, [9, 10, 11, 12, 13], 0, 64)]))
        client.end(rid)
    finally:
        client.close()


def test_a_run_kvtier_served_passes_and_reports_its_tokens(worker: WorkerSide) -> None:
    with _served(handle(worker), "kvtier_cpu", (64, 64), tier="cpu") as counts:
        serve(worker, "a")
    assert counts == {"retrieved_tokens": 64}


def test_a_run_kvtier_did_not_serve_fails_instead_of_giving_a_figure(
    worker: WorkerSide,
) -> None:
    # vLLM's own prefix cache answered (no reset): kvtier retrieved nothing.
    with (
        pytest.raises(
            AssertionError, match="kvtier_cpu: kvtier served 0 tokens, expected 32 to 64"
        ),
        _served(handle(worker), "kvtier_cpu", (32, 64), tier="cpu"),
    ):
        pass


def test_a_run_served_by_another_tier_fails(worker: WorkerSide) -> None:
    with (
        pytest.raises(AssertionError, match="the disk tier served 0 of the 64 tokens"),
        _served(handle(worker), "kvtier_disk", (64, 64), tier="disk"),
    ):
        serve(worker, "b")


def test_a_run_meant_for_vllms_own_cache_fails_when_kvtier_served(worker: WorkerSide) -> None:
    with (
        pytest.raises(AssertionError, match="apc: kvtier served 64 tokens, expected 0"),
        _served(handle(worker), "apc", (0, 0)),
    ):
        serve(worker, "c")


def test_a_refused_prefix_cache_reset_fails(worker: WorkerSide) -> None:
    _reset_prefix_cache(handle(worker, reset=True))
    with pytest.raises(AssertionError, match="refused to reset its prefix cache"):
        _reset_prefix_cache(handle(worker, reset=False))


def resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore(2) over a read-only map)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    resident = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        try:
            address = ctypes.c_void_p(view.ctypes.data)
            if LIBC.mincore(address, ctypes.c_size_t(size), resident) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on {path}")
        finally:
            del view  # the map closes only once no array looks into it
    return sum(byte & 1 for byte in resident)


def test_page_cache_drop_evicts_every_file_of_the_disk_directory(tmp_path: Path) -> None:
    """The bench's cold runs read the disk tier from the disk: every page of every file (in
    subdirectories too, as the tier's) leaves the page cache, and the bytes stay the same.
    (On a host whose temporary directory is a tmpfs, where nothing can be evicted, run pytest
    with ``--basetemp`` on a disk: the bench's own disk directory must be on one too.)"""
    (tmp_path / "sub").mkdir()
    files = {tmp_path / "sub" / "a.kvc": b"x" * 5 * mmap.PAGESIZE, tmp_path / "b.kvc": b"y" * 100}
    for path, data in files.items():
        path.write_bytes(data)
        assert path.read_bytes() == data
        assert resident_pages(path) > 0  # just written and read: cached
    _drop_page_cache(tmp_path)
    assert {path: resident_pages(path) for path in files} == dict.fromkeys(files, 0)
    for path, data in files.items():
        assert path.read_bytes() == data
