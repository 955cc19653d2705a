"""One ``max_local_disk_size`` per directory, across every fingerprint written there.

The server opens one disk tier per model on one directory; each redeploy (a new model path,
chunk size or TP layout) is a new fingerprint. These tests check the directory's real files,
not only the tiers' counters.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.base import PutOutcome
from kvtier.storage.disk.tier import DiskTier
from tests.storage.disk.disk_helpers import RECORD_BYTES, chunk_files, make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    payload,
    put_and_wait,
    random_key,
)

BUDGET = 4  # chunk files


def model(i: int) -> Fingerprint:
    return Fingerprint(f"model-{i}", CONTRACT_LAYOUT, CONTRACT_CHUNK)


def disk_bytes(path: Path) -> int:
    """What the chunk files in the directory really hold (every fingerprint's)."""
    return sum(os.path.getsize(path / name) for name in chunk_files(path))


def files_of(path: Path, fp: Fingerprint) -> list[str]:
    return [n for n in chunk_files(path) if n.startswith(f"{fp.hex()}-")]


def name_of(fp: Fingerprint, key: ChunkKey) -> str:
    return f"{fp.hex()}-{key.hex()}.kvc"


def age(path: Path, names: list[str], seconds: int) -> None:
    for name in names:
        os.utime(path / name, ns=(seconds * 10**9, seconds * 10**9))


def fill(tier: DiskTier, count: int, seed: int = 0) -> list[ChunkKey]:
    keys = [random_key() for _ in range(count)]
    for i, key in enumerate(keys):
        result = put_and_wait(tier, key, payload(CONTRACT_CHUNK, seed + i), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.STORED
    return keys


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[list[DiskTier]]:
    """Tiers a test opens on ``tmp_path``; all closed at the end."""
    tiers: list[DiskTier] = []
    yield tiers
    for tier in tiers:
        tier.close()


def open_model(path: Path, i: int, opened: list[DiskTier], records: int = BUDGET) -> DiskTier:
    tier = make_tier(path, capacity_records=records, fingerprint=model(i))
    tier.open()
    assert tier.index_checked(10.0)
    opened.append(tier)
    return tier


def test_models_released_one_after_another_share_one_budget(tmp_path: Path) -> None:
    """The server's redeploys: each model fills the directory, then is released."""
    for i in range(8):
        tier = make_tier(tmp_path, capacity_records=BUDGET, fingerprint=model(i))
        tier.open()
        try:
            assert tier.index_checked(10.0)
            for j in range(BUDGET):
                fill(tier, 1, seed=10 * i + j)
                assert disk_bytes(tmp_path) <= BUDGET * RECORD_BYTES
        finally:
            tier.close()
        assert disk_bytes(tmp_path) <= BUDGET * RECORD_BYTES
    assert len(files_of(tmp_path, model(7))) == BUDGET  # the newest model kept its files


def test_models_open_together_share_one_budget(tmp_path: Path, opened: list[DiskTier]) -> None:
    tiers = [open_model(tmp_path, i, opened) for i in range(8)]
    for round_ in range(BUDGET):
        for i, tier in enumerate(tiers):
            fill(tier, 1, seed=100 * round_ + i)
            assert disk_bytes(tmp_path) <= BUDGET * RECORD_BYTES
    used = sum(t.usage().used_bytes for t in tiers)
    assert used == disk_bytes(tmp_path) == BUDGET * RECORD_BYTES
    assert all(t.usage().capacity_bytes == BUDGET * RECORD_BYTES for t in tiers)
    assert sum(t.counters.evicted for t in tiers) == 8 * BUDGET - BUDGET


def test_a_released_models_files_go_before_an_open_models(
    tmp_path: Path, opened: list[DiskTier]
) -> None:
    kept = open_model(tmp_path, 0, opened)
    kept_keys = fill(kept, 2)
    age(tmp_path, [name_of(model(0), k) for k in kept_keys], 1)  # the oldest files of all
    released = make_tier(tmp_path, capacity_records=BUDGET, fingerprint=model(1))
    released.open()
    fill(released, 2)
    released.close()

    newcomer = open_model(tmp_path, 2, opened)
    fill(newcomer, 2)
    assert files_of(tmp_path, model(1)) == []
    assert sorted(files_of(tmp_path, model(0))) == sorted(name_of(model(0), k) for k in kept_keys)
    assert kept.contains(kept_keys) == [True, True]
    assert disk_bytes(tmp_path) == BUDGET * RECORD_BYTES


def leave_files(path: Path, fp: Fingerprint, count: int, mtime_s: int) -> list[str]:
    """Files of ``fp`` written earlier (by another kvtier, or before a restart) and left."""
    elsewhere = path / f"elsewhere-{fp.hex()}"
    tier = make_tier(elsewhere, capacity_records=count, fingerprint=fp)
    tier.open()
    try:
        keys = fill(tier, count)
    finally:
        tier.close()
    names = [name_of(fp, k) for k in keys]
    for i, name in enumerate(names):
        os.rename(elsewhere / name, path / name)
        age(path, [name], mtime_s + i)
    return names


@pytest.mark.parametrize("saved_index", [False, True], ids=["scan", "saved-index"])
def test_a_directory_over_budget_at_open_is_trimmed(
    tmp_path: Path, opened: list[DiskTier], saved_index: bool
) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    if saved_index:  # the opening model's own (empty) index, saved by a clean close
        own = make_tier(directory, capacity_records=BUDGET, fingerprint=model(9))
        own.open()
        own.close()
        assert (directory / f".{model(9).hex()}.index").exists()
    left = [leave_files(directory, model(i), 3, mtime_s=100 * (i + 1)) for i in range(3)]
    assert disk_bytes(directory) == 9 * RECORD_BYTES

    tier = open_model(directory, 9, opened)
    assert disk_bytes(directory) <= BUDGET * RECORD_BYTES
    newest = left[2] + left[1][2:]  # the oldest files go first
    assert sorted(chunk_files(directory)) == sorted(newest)
    fill(tier, 2)
    assert disk_bytes(directory) <= BUDGET * RECORD_BYTES
    assert sorted(chunk_files(directory)) == sorted(left[2][1:] + files_of(directory, model(9)))


def test_pinned_files_survive_another_models_writes(tmp_path: Path, opened: list[DiskTier]) -> None:
    first = open_model(tmp_path, 0, opened)
    keys = fill(first, BUDGET)
    assert first.pin_many(keys[:2]) == 2
    second = open_model(tmp_path, 1, opened)
    fill(second, BUDGET)
    assert first.contains(keys) == [True, True, False, False]
    assert all((tmp_path / name_of(model(0), k)).exists() for k in keys[:2])
    assert disk_bytes(tmp_path) == BUDGET * RECORD_BYTES
    assert first.pin_many(keys[:0]) == 0
    second.pin_many(second.index.oldest_first())  # now every file in the directory is pinned
    result = put_and_wait(second, random_key(), payload(CONTRACT_CHUNK, 7), CONTRACT_CHUNK)
    assert result.outcome is PutOutcome.DROPPED
    assert disk_bytes(tmp_path) == BUDGET * RECORD_BYTES


def test_two_sizes_on_one_directory_the_smaller_wins(
    tmp_path: Path, opened: list[DiskTier], caplog: pytest.LogCaptureFixture
) -> None:
    large = open_model(tmp_path, 0, opened, records=2 * BUDGET)
    with caplog.at_level(logging.INFO, logger="kvtier.storage.disk"):
        small = open_model(tmp_path, 1, opened, records=BUDGET)
    said = [r for r in caplog.records if "max_local_disk_size" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    fill(large, 2 * BUDGET)
    assert disk_bytes(tmp_path) == BUDGET * RECORD_BYTES
    assert large.usage().capacity_bytes == small.usage().capacity_bytes == BUDGET * RECORD_BYTES


def test_tiers_writing_at_once_keep_the_budget(tmp_path: Path, opened: list[DiskTier]) -> None:
    """Each write may evict another tier's files: no lock order to deadlock on, and the
    directory's bytes stay within the budget."""
    tiers = [open_model(tmp_path, i, opened) for i in range(4)]
    failures: list[BaseException] = []

    def write(tier: DiskTier, seed: int) -> None:
        try:
            fill(tier, 12, seed=seed)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(t, 100 * i)) for i, t in enumerate(tiers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30.0)
    assert not any(t.is_alive() for t in threads) and failures == []
    assert disk_bytes(tmp_path) == sum(t.usage().used_bytes for t in tiers)
    assert disk_bytes(tmp_path) <= BUDGET * RECORD_BYTES
