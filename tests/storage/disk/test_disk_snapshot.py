"""The disk tier's saved index (kvtier.storage.disk.snapshot): a restart that serves from it
at once, without listing or opening a file, then checks it against the directory in the
background (kvtier.storage.disk.reconcile), reading the headers of only the files it does
not name, and never serves a wrong byte."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.fingerprint import Fingerprint
from kvtier.storage.disk import files, snapshot
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE, encode_header
from tests.storage.disk.disk_helpers import FP, RECORD_BYTES, make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    payload,
    put_and_wait,
    random_key,
)

INDEX = f".{FP.hex()}.index"


def read(tier: DiskTier, key: bytes) -> tuple[int | None, torch.Tensor]:
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    return tier.get_into(key, out), out


def filled(path: Path, n: int) -> list[bytes]:
    tier = make_tier(path)
    tier.open()
    keys = [random_key() for _ in range(n)]
    for i, key in enumerate(keys):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
    tier.close()
    return keys


def count_header_reads(monkeypatch: object) -> list[str]:
    """Record every file the startup scan opens to read a header."""
    opened: list[str] = []
    real = files.check_file

    def spy(dir_fd: int, name: str, key: bytes, fingerprint: Fingerprint) -> object:
        opened.append(name)
        return real(dir_fd, name, key, fingerprint)

    monkeypatch.setattr(files, "check_file", spy)  # type: ignore[attr-defined]
    return opened


def test_a_clean_close_saves_the_index_and_the_restart_reads_no_header(
    tmp_path: Path, monkeypatch: object
) -> None:
    keys = filled(tmp_path, 5)
    assert (tmp_path / INDEX).is_file()
    opened = count_header_reads(monkeypatch)
    tier = make_tier(tmp_path)
    tier.open()
    try:
        assert opened == []  # every file was named by the saved index
        assert tier.contains(keys) == [True] * 5
        assert tier.usage().used_bytes == 5 * RECORD_BYTES
        for i, key in enumerate(keys):
            tokens, out = read(tier, key)
            assert tokens == CONTRACT_CHUNK and torch.equal(out, payload(CONTRACT_CHUNK, i))
    finally:
        tier.close()


def test_files_written_or_removed_after_the_save_are_reconciled(
    tmp_path: Path, monkeypatch: object
) -> None:
    """As after a crash: the saved index is older than the directory."""
    keys = filled(tmp_path, 4)
    gone = keys[1]
    os.unlink(tmp_path / files.final_name(FP.hex(), gone))
    new = random_key()
    data = payload(CONTRACT_CHUNK, 7)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:  # a record landed after the save, as a process that crashed before its close
        files.write_record(
            fd,
            new,
            FP.hex(),
            encode_header(new, FP, CONTRACT_CHUNK, data),
            memoryview(data.numpy()),  # type: ignore[arg-type]
        )
    finally:
        os.close(fd)
    opened = count_header_reads(monkeypatch)
    tier = make_tier(tmp_path)
    tier.open()
    try:
        assert tier.index_checked(10.0)
        assert opened == [files.final_name(FP.hex(), new)]  # only the file it did not name
        assert tier.contains([*keys, new]) == [True, False, True, True, True]
        assert tier.usage().entries == 4
        assert tier.usage().used_bytes == 4 * RECORD_BYTES
        tokens, out = read(tier, new)
        assert tokens == CONTRACT_CHUNK and torch.equal(out, data)
    finally:
        tier.close()


def test_a_restart_serves_from_the_saved_index_before_listing_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open builds the index from the saved one alone: with the directory listing held
    up, the tier is open and serves hits (a file removed since the save is a miss at its
    read, never a wrong byte); the check then finishes on its own and drops that entry."""
    keys = filled(tmp_path, 4)
    os.unlink(tmp_path / files.final_name(FP.hex(), keys[2]))
    release = threading.Event()
    listing = threading.Event()
    real_names = files.names

    def held_names(dir_fd: int) -> Iterator[str]:
        listing.set()
        assert release.wait(30.0)
        yield from real_names(dir_fd)

    monkeypatch.setattr(files, "names", held_names)
    tier = make_tier(tmp_path)
    opened = threading.Thread(target=tier.open)
    opened.start()
    opened.join(10.0)
    try:
        assert not opened.is_alive(), "the open waited for the directory listing"
        assert listing.wait(10.0) and not tier.index_checked(0)
        assert tier.contains(keys) == [True] * 4  # trusted, not yet checked
        tokens, out = read(tier, keys[3])
        assert tokens == CONTRACT_CHUNK and torch.equal(out, payload(CONTRACT_CHUNK, 3))
        assert read(tier, keys[2])[0] is None  # its file is gone: a miss at the read
        assert tier.counters.corrupt == 0
    finally:
        release.set()
    try:
        assert tier.index_checked(10.0)
        assert tier.contains(keys) == [True, True, False, True]
        assert tier.usage().entries == 3
    finally:
        tier.close()


def test_the_background_check_spares_writes_made_since_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts that land while the check lists the directory are neither re-added from their
    header, nor dropped as gone, nor their temporary files removed."""
    keys = filled(tmp_path, 2)
    release = threading.Event()
    real_names = files.names

    def held_names(dir_fd: int) -> Iterator[str]:
        assert release.wait(30.0)
        yield from real_names(dir_fd)

    monkeypatch.setattr(files, "names", held_names)
    tier = make_tier(tmp_path)
    tier.open()
    try:
        fresh = [random_key() for _ in range(3)]
        for i, key in enumerate(fresh):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, 10 + i), CONTRACT_CHUNK)
        release.set()
        assert tier.index_checked(10.0)
        assert tier.contains([*keys, *fresh]) == [True] * 5
        assert tier.usage().entries == 5 and tier.usage().used_bytes == 5 * RECORD_BYTES
        for i, key in enumerate(fresh):
            tokens, out = read(tier, key)
            assert tokens == CONTRACT_CHUNK and torch.equal(out, payload(CONTRACT_CHUNK, 10 + i))
    finally:
        release.set()
        tier.close()


def test_a_trusted_file_corrupted_while_closed_is_a_miss_at_its_first_read(tmp_path: Path) -> None:
    keys = filled(tmp_path, 2)
    name = tmp_path / files.final_name(FP.hex(), keys[0])
    with open(name, "r+b") as f:
        f.seek(HEADER_SIZE + 3)
        f.write(b"\x00\xff")
    tier = make_tier(tmp_path)
    tier.open()
    try:
        assert tier.contains(keys) == [True, True]  # named by the index: not opened at open
        assert read(tier, keys[0])[0] is None  # the payload checksum catches it
        assert tier.counters.corrupt == 1 and not name.exists()
        assert tier.contains(keys) == [False, True]
        assert read(tier, keys[1])[0] == CONTRACT_CHUNK
    finally:
        tier.close()


def test_a_torn_or_foreign_saved_index_is_ignored_and_every_header_read(
    tmp_path: Path, monkeypatch: object
) -> None:
    keys = filled(tmp_path, 3)
    index = tmp_path / INDEX
    saved = index.read_bytes()
    other = Fingerprint("other-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
    flipped = saved[:30] + bytes([saved[30] ^ 1]) + saved[31:]  # an entry: the checksum
    for damaged in (saved[:-5], saved[:20] + b"\x01" + saved[21:], flipped, b""):
        index.write_bytes(damaged)
        opened = count_header_reads(monkeypatch)
        tier = make_tier(tmp_path)
        tier.open()
        try:
            assert len(opened) == 3
            assert tier.contains(keys) == [True] * 3
        finally:
            tier.close()
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            assert snapshot.load(fd, FP) is not None  # the close saved a good one again
        finally:
            os.close(fd)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert snapshot.load(fd, other) is None  # no index saved under its name
        snapshot.save(fd, other, [snapshot.SavedEntry(keys[0], 1, 2)])
        os.rename(f".{other.hex()}.index", INDEX, src_dir_fd=fd, dst_dir_fd=fd)
        assert snapshot.load(fd, FP) is None  # another fingerprint's index under our name
    finally:
        os.close(fd)


def test_a_leftover_partial_save_is_removed_at_open(tmp_path: Path) -> None:
    filled(tmp_path, 1)
    leftover = tmp_path / f"{INDEX}.4242.part"
    leftover.write_bytes(b"half an index")
    chunk_leftover = tmp_path / f".{FP.hex()}-{'ab' * 16}.4242-0.tmp"
    chunk_leftover.write_bytes(b"half a chunk")
    tier = make_tier(tmp_path)
    tier.open()
    try:
        assert tier.index_checked(10.0)
        assert not leftover.exists() and not chunk_leftover.exists()
        assert tier.counters.temp_removed == 2
    finally:
        tier.close()


def test_lru_order_and_capacity_trim_survive_a_restart_through_the_saved_index(
    tmp_path: Path,
) -> None:
    keys = filled(tmp_path, 3)
    tier = make_tier(tmp_path)
    tier.open()
    assert read(tier, keys[0])[0] == CONTRACT_CHUNK  # keys[1] is now the least recently used
    tier.close()
    smaller = make_tier(tmp_path, capacity_records=2)
    smaller.open()
    try:
        assert smaller.contains(keys) == [True, False, True]
    finally:
        smaller.close()
