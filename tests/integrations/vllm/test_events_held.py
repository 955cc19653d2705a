"""The fleet's view equals what kvtier holds: after each fault, the chunks that the published
KV events say a tier holds (stores minus removals, per medium) are exactly the chunks that
tier holds. A real worker side, real CPU / disk / Redis tiers, no vLLM process."""

from __future__ import annotations

import resource
import shutil
import signal
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.keys import ChunkKey
from kvtier.storage.disk import files
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE
from kvtier.storage.redis.tier import RedisTier
from tests.integrations.vllm.worker_helpers import BLOCK, CHUNK, CHUNK_BYTES, fill, make_worker
from tests.redis_servers import RedisServer

RECORD_BYTES = HEADER_SIZE + CHUNK_BYTES


class FleetView:
    """A worker and what the router learns of it: every event taken, applied in order."""

    def __init__(self, worker: WorkerSide) -> None:
        assert worker.engine is not None
        self.worker = worker
        self.engine = worker.engine
        self.keys: list[ChunkKey] = []  # every chunk saved so far
        self.blocks: dict[str, set[bytes]] = defaultdict(set)  # medium -> block names
        self._saves = 0

    def save(self, chunks: int = 1) -> list[ChunkKey]:
        """Save a new prompt of ``chunks`` whole chunks; returns its chunk keys."""
        n = self._saves
        self._saves += 1
        tokens = [100_000 * (n + 1) + t for t in range(chunks * CHUNK)]
        blocks = list(range(1, chunks * CHUNK // BLOCK + 1))
        fill(self.worker, blocks, seed=n)
        spec = SaveSpec(f"save-{n}", tokens, blocks, 0, len(tokens))
        self.worker.save(KVTierMetadata(saves=[spec]))
        keys = [s.key for s in self.engine.keychain.keys(tokens, include_partial=False)]
        self.keys += keys
        return keys

    def held(self) -> dict[str, set[ChunkKey]]:
        """Medium -> the saved chunks its tier holds (asked first: asking may notice a loss)."""
        out: dict[str, set[ChunkKey]] = {}
        for tier in self.engine.tiers():
            if tier.medium is not None:
                answers = tier.contains(self.keys)
                out[tier.medium] = {k for k, has in zip(self.keys, answers, strict=True) if has}
        return out

    def published(self) -> dict[str, set[ChunkKey]]:
        """Medium -> the chunks the events taken so far say it holds (every block of one)."""
        for event in self.worker.take_events():
            if event[0] == "stored":
                self.blocks[event[5]].update(event[1])
            else:
                self.blocks[event[2]].difference_update(event[1])
        per_chunk = CHUNK // BLOCK
        out: dict[str, set[ChunkKey]] = {}
        for medium, names in self.blocks.items():
            keys = {name[:-2] for name in names}
            out[medium] = {
                k for k in keys if all(k + j.to_bytes(2, "big") in names for j in range(per_chunk))
            }
        return out

    def check(self) -> dict[str, set[ChunkKey]]:
        """Assert published == held for every published tier; returns what is held."""
        held = self.held()
        published = self.published()
        for medium, keys in held.items():
            assert published.get(medium, set()) == keys, medium
        assert set(published) <= set(held)
        return held

    def tier(self, cls: type[Any]) -> Any:
        (tier,) = [t for t in self.engine.tiers() if isinstance(t, cls)]
        return tier


@pytest.fixture
def make_view() -> Iterator[Any]:
    workers: list[WorkerSide] = []

    def make(**overrides: object) -> FleetView:
        worker = make_worker(model_name=f"held-{uuid.uuid4().hex[:8]}", **overrides)
        workers.append(worker)
        return FleetView(worker)

    yield make
    for worker in workers:
        worker.close()


def disk_overrides(path: Path, **extra: object) -> dict[str, object]:
    return {
        "local_disk": str(path),
        "max_local_disk_size": f"{64 * RECORD_BYTES}B",
        "extra_config": {"disk_max_inflight_bytes": f"{8 * RECORD_BYTES}B", **extra},
    }


def test_a_save_into_a_cpu_tier_of_pinned_pages_is_not_published(make_view: Any) -> None:
    view = make_view()
    for _ in range(8):  # the CPU tier's 8 pages
        view.save()
    for i in range(8):  # each pinned by a request that is still running
        assert view.engine.lookup(_tokens(i), f"pin-{i}").tokens == CHUNK
    view.save()  # no page can be freed: dropped
    assert view.engine.stats()["dropped_chunks"] == 1
    assert len(view.check()["CPU"]) == 8
    for i in range(8):
        view.engine.end_request(f"pin-{i}")


def _tokens(n: int) -> list[int]:
    """The tokens of :meth:`FleetView.save`'s ``n``-th single-chunk prompt."""
    return [100_000 * (n + 1) + t for t in range(CHUNK)]


def test_a_disk_write_is_published_when_it_lands_not_when_it_is_queued(
    make_view: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes in flight are not held yet; a write the full queue refused never is."""
    gate = threading.Event()
    write_record = files.write_record

    def slow_write(*args: Any) -> None:
        assert gate.wait(30)
        write_record(*args)

    monkeypatch.setattr(files, "write_record", slow_write)
    view = make_view(**disk_overrides(tmp_path, disk_max_inflight_bytes=f"{2 * RECORD_BYTES}B"))
    for _ in range(3):
        view.save()  # two queued, the third refused: too many bytes in flight
    assert view.check()["DISK"] == set()
    gate.set()
    assert view.engine.flush(30)
    assert len(view.check()["DISK"]) == 2


def test_a_disk_write_that_fails_on_a_full_file_system_is_not_published(
    make_view: Any, tmp_path: Path
) -> None:
    """Files limited to 1 KiB (RLIMIT_FSIZE, which binds root too): every write fails with
    EFBIG, one of the errors of a full disk."""
    view = make_view(**disk_overrides(tmp_path))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        view.save(chunks=2)
        assert view.engine.flush(30)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    disk = view.tier(DiskTier)
    assert disk.counters.failed == 2 and disk.counters.no_space == 2
    held = view.check()
    assert held["DISK"] == set() and len(held["CPU"]) == 2


def test_a_store_to_a_redis_that_is_down_is_not_published(make_view: Any) -> None:
    server = RedisServer().start()
    try:
        view = make_view(remote_url=server.url, blocking_timeout_secs=1.0)
        (landed,) = view.save()
        assert view.engine.flush(30)
        assert view.check()["REMOTE"] == {landed}
        server.stop()
        lost = view.save(chunks=2)
        assert view.engine.flush(30)
        # What the down server holds cannot be asked: the chunk stored before stays published
        # (events.py: a chunk that leaves on the server's side is not seen), the two stored
        # while it was down never are.
        assert view.published()["REMOTE"] == {landed}
        server.start()
        assert view.tier(RedisTier).contains(lost) == [False, False]
    finally:
        server.cleanup()


def test_clear_removes_what_it_dropped_from_every_tier(
    make_view: Any, tmp_path: Path, redis_server: RedisServer
) -> None:
    """vLLM's reset_prefix_cache and the admin API's POST /clear: Engine.clear."""
    view = make_view(**disk_overrides(tmp_path), remote_url=redis_server.url)
    view.save(chunks=2)
    view.save()
    assert view.engine.flush(30)
    held = view.check()
    assert [len(held[m]) for m in ("CPU", "DISK", "REMOTE")] == [3, 3, 3]
    assert view.engine.clear() == {"cpu": 3, "disk": 3, "redis": 3}
    held = view.check()
    assert held == {"CPU": set(), "DISK": set(), "REMOTE": set()}


def test_a_corrupt_disk_chunk_is_removed_when_a_read_finds_it(
    make_view: Any, tmp_path: Path
) -> None:
    view = make_view(**disk_overrides(tmp_path))
    first, second = view.save(chunks=2)
    assert view.engine.flush(30)
    assert len(view.check()["DISK"]) == 2
    disk = view.tier(DiskTier)
    (path,) = tmp_path.rglob(f"*{second.hex()}*.kvc")
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        f.write(b"\xff" * 64)
    assert disk.get_into(second, torch.empty(CHUNK_BYTES, dtype=torch.uint8)) is None
    assert disk.counters.corrupt == 1
    assert view.check()["DISK"] == {first}


def test_a_lost_disk_directory_removes_all_its_chunks(make_view: Any, tmp_path: Path) -> None:
    view = make_view(**disk_overrides(tmp_path / "disk"))
    view.save(chunks=2)
    assert view.engine.flush(30)
    assert len(view.check()["DISK"]) == 2
    shutil.rmtree(tmp_path / "disk")
    held = view.check()  # the tier notices the loss when asked
    assert held["DISK"] == set() and len(held["CPU"]) == 2
    assert view.tier(DiskTier).counters.directory_lost == 1


def test_a_corrupt_redis_record_is_removed_when_a_read_finds_it(
    make_view: Any, redis_server: RedisServer
) -> None:
    view = make_view(remote_url=redis_server.url)
    first, second = view.save(chunks=2)
    assert view.engine.flush(30)
    assert len(view.check()["REMOTE"]) == 2
    redis = view.tier(RedisTier)
    redis_server.client().set(redis.store.name_of(second), b"\x00" * RECORD_BYTES)
    assert redis.get_into(second, torch.empty(CHUNK_BYTES, dtype=torch.uint8)) is None
    assert view.check()["REMOTE"] == {first}
