"""The disk tier on its own: contract, restart, corruption, capacity, throttling, config."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, StateError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.base import PutJob, PutOutcome, PutResult
from kvtier.storage.disk.files import READ_BLOCK
from kvtier.storage.disk.options import DiskOptions, parse_local_disk
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import small_config
from tests.storage.disk.disk_helpers import FP, RECORD_BYTES, chunk_files, make_tier, temp_files
from tests.storage.test_records import v1_record
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    Outcomes,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)


class TestDiskTierContract(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[DiskTier]:
        tier = make_tier(tmp_path)
        tier.open()
        yield tier
        tier.close()
        assert temp_files(tmp_path) == []


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    tier = make_tier(tmp_path)
    tier.open()
    yield tier
    tier.close()


def read(tier: DiskTier, key: bytes) -> tuple[int | None, torch.Tensor]:
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    return tier.get_into(key, out), out


# -- restart ---------------------------------------------------------------------------------
def test_index_survives_a_restart_and_keeps_lru_order(tmp_path: Path) -> None:
    first = make_tier(tmp_path, capacity_records=3)
    first.open()
    keys = [random_key() for _ in range(3)]
    for i, key in enumerate(keys):
        put_and_wait(first, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        # distinct mtimes: the restart orders files by them
        os.utime(tmp_path / f"{FP.hex()}-{key.hex()}.kvc", ns=(i * 10**9, i * 10**9))
    first.close()

    second = make_tier(tmp_path, capacity_records=3)
    second.open()
    try:
        assert second.contains(keys) == [True, True, True]
        assert second.usage().entries == 3 and second.usage().used_bytes == 3 * RECORD_BYTES
        for i, key in enumerate(keys):
            tokens, out = read(second, key)
            assert tokens == CONTRACT_CHUNK and torch.equal(out, payload(CONTRACT_CHUNK, i))
        # keys[0] was read first, so keys[0] is the oldest again: it is the one evicted
        put_and_wait(second, random_key(), payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
        assert second.contains(keys) == [False, True, True]
    finally:
        second.close()


def test_read_hits_are_remembered_across_a_restart(tmp_path: Path) -> None:
    first = make_tier(tmp_path, capacity_records=3)
    first.open()
    keys = [random_key() for _ in range(3)]
    for i, key in enumerate(keys):
        put_and_wait(first, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        os.utime(tmp_path / f"{FP.hex()}-{key.hex()}.kvc", ns=(i * 10**9, i * 10**9))
    assert read(first, keys[0])[0] == CONTRACT_CHUNK  # the oldest write, used just now
    first.close()
    second = make_tier(tmp_path, capacity_records=3)
    second.open()
    try:
        put_and_wait(second, random_key(), payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
        assert second.contains(keys) == [True, False, True]  # keys[1] was least recently used
    finally:
        second.close()


def test_open_removes_temp_leftovers_and_bad_files_and_counts_them(tmp_path: Path) -> None:
    first = make_tier(tmp_path)
    first.open()
    good, short, flipped = random_key(), random_key(), random_key()
    for i, key in enumerate((good, short, flipped)):
        put_and_wait(first, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
    first.close()
    fp = FP.hex()
    # The full scan's checks: without a saved index every header is read at open (with one,
    # listed files are trusted and checked at their first read: test_disk_snapshot.py).
    (tmp_path / f".{fp}.index").unlink()
    with open(tmp_path / f"{fp}-{short.hex()}.kvc", "r+b") as f:
        f.truncate(HEADER_SIZE + 100)
    with open(tmp_path / f"{fp}-{flipped.hex()}.kvc", "r+b") as f:
        f.seek(80)  # payload length field: caught by the header checksum
        f.write(b"\xff")
    (tmp_path / f".{fp}-{random_key().hex()}.123-0.tmp").write_bytes(b"half a write")
    (tmp_path / f"{fp}-nothex.kvc").write_bytes(b"junk")
    other_fp = Fingerprint("other-model", CONTRACT_LAYOUT, CONTRACT_CHUNK).hex()
    foreign = [f"{other_fp}-{random_key().hex()}.kvc", f".{other_fp}-x.1-0.tmp", "notes.txt"]
    for name in foreign:
        (tmp_path / name).write_bytes(b"not ours")

    second = make_tier(tmp_path)
    second.open()
    try:
        assert second.contains([good, short, flipped]) == [True, False, False]
        assert second.counters.temp_removed == 1
        assert second.counters.bad_removed_at_open == 3
        assert second.counters.corrupt == 3
        assert sorted(os.listdir(tmp_path)) == sorted([f"{fp}-{good.hex()}.kvc", *foreign])
    finally:
        second.close()


def test_open_trims_to_a_smaller_capacity(tmp_path: Path) -> None:
    first = make_tier(tmp_path, capacity_records=4)
    first.open()
    for i in range(4):
        put_and_wait(first, random_key(), payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
    first.close()
    second = make_tier(tmp_path, capacity_records=2)
    second.open()
    try:
        assert second.usage().entries == 2
        assert len(chunk_files(tmp_path)) == 2
    finally:
        second.close()


# -- corruption on read ----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["payload", "header", "truncate", "append", "delete", "swap"])
def test_a_file_changed_under_us_is_a_miss_never_wrong_bytes(
    tier: DiskTier, tmp_path: Path, where: str
) -> None:
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    path = tmp_path / f"{FP.hex()}-{key.hex()}.kvc"
    data = bytearray(path.read_bytes())
    if where == "payload":
        data[HEADER_SIZE + 1234] ^= 0x04
    elif where == "header":
        data[77] ^= 0x01  # token count
    elif where == "truncate":
        data = data[:-1]
    elif where == "append":
        data += b"\0"
    if where == "swap":  # a valid record of another key under this key's name
        other = random_key()
        put_and_wait(tier, other, payload(CONTRACT_CHUNK, 2), CONTRACT_CHUNK)
        data = bytearray((tmp_path / f"{FP.hex()}-{other.hex()}.kvc").read_bytes())
    if where == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    assert tier.contains([key]) == [True]  # the index does not know yet
    tokens, _ = read(tier, key)
    assert tokens is None
    assert tier.contains([key]) == [False]
    assert not path.exists()
    assert tier.counters.corrupt == (0 if where == "delete" else 1)
    assert tier.counters.hits == 0


def test_get_many_into_reads_a_batch(tier: DiskTier) -> None:
    keys = [random_key() for _ in range(6)]
    for i, key in enumerate(keys[:5]):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK - i, i), CONTRACT_CHUNK - i)
    outs = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
    assert tier.get_many_into(list(zip(keys, outs, strict=True))) == [16, 15, 14, 13, 12, None]
    for i in range(5):
        data = payload(CONTRACT_CHUNK - i, i)
        assert torch.equal(outs[i][: data.numel()], data)


def test_get_into_a_too_small_buffer_is_refused_and_keeps_the_file(tier: DiskTier) -> None:
    key = random_key()
    put_and_wait(tier, key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    with pytest.raises(ValueError, match="bytes"):
        tier.get_into(key, torch.zeros(PAGE_BYTES - 1, dtype=torch.uint8))
    assert read(tier, key)[0] == CONTRACT_CHUNK


# -- capacity, pins and throttling -------------------------------------------------------------
def test_lru_eviction_skips_pinned_files(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_records=3)
    tier.open()
    try:
        keys = [random_key() for _ in range(3)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        assert tier.pin(keys[0]) and tier.pin(keys[0])  # two pins on the oldest
        new = random_key()
        assert (
            put_and_wait(tier, new, payload(CONTRACT_CHUNK, 5), CONTRACT_CHUNK).outcome
            is PutOutcome.STORED
        )
        assert tier.contains([*keys, new]) == [True, False, True, True]
        assert tier.counters.evicted == 1
        assert len(chunk_files(tmp_path)) == 3
        tier.unpin(keys[0])
        assert tier.clear() == 2  # still pinned once
        tier.unpin(keys[0])
        tier.unpin(keys[0])  # one too many: ignored, never negative
        assert tier.counters.pinned_keys == 0
        assert tier.clear() == 1
        assert chunk_files(tmp_path) == []
    finally:
        tier.close()


def test_a_disk_full_of_pinned_files_drops_the_write(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_records=2)
    tier.open()
    try:
        keys = [random_key() for _ in range(2)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
            assert tier.pin(key)
        result = put_and_wait(tier, random_key(), payload(CONTRACT_CHUNK, 3), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.DROPPED and "pinned" in result.detail
        assert tier.counters.dropped_no_room == 1
        assert tier.contains(keys) == [True, True]
    finally:
        tier.close()


def test_a_chunk_larger_than_the_capacity_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_records=1)
    tier.open()
    try:
        big = torch.zeros(PAGE_BYTES + 4096, dtype=torch.uint8)
        done = Outcomes()
        tier.put(PutJob(random_key(), big, CONTRACT_CHUNK, "", done))
        (result,) = done.wait(1)
        assert result.outcome is PutOutcome.DROPPED
        assert "larger than max_local_disk_size" in result.detail
        assert tier.counters.dropped_too_large == 1
    finally:
        tier.close()


def test_bytes_in_flight_are_bounded_and_excess_puts_drop_at_once(tmp_path: Path) -> None:
    """A stalled disk (simulated by a callback that blocks the only writer thread) must not
    make put wait: past the bound, puts complete at once as DROPPED."""
    tier = make_tier(tmp_path, inflight_records=2, threads=1)
    tier.open()
    gate = threading.Event()
    first_done = threading.Event()
    results: list[PutResult] = []
    lock = threading.Lock()

    def slow(result: PutResult) -> None:
        with lock:
            results.append(result)
        first_done.set()
        assert gate.wait(10)

    def record(result: PutResult) -> None:
        with lock:
            results.append(result)

    try:
        tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, 0), CONTRACT_CHUNK, "", slow))
        assert first_done.wait(10)  # the writer is now stuck in the callback, still in flight
        queued = PutJob(random_key(), payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK, "", record)
        tier.put(queued)
        for i in range(3):
            tier.put(
                PutJob(random_key(), payload(CONTRACT_CHUNK, 2 + i), CONTRACT_CHUNK, "", record)
            )
        with lock:
            dropped = [r for r in results if r.outcome is PutOutcome.DROPPED]
        assert len(dropped) == 3 and "in flight" in dropped[0].detail
        assert tier.counters.dropped_inflight == 3
        assert tier.flush(0.05) is False  # still in flight
    finally:
        gate.set()
        assert tier.flush(10)
        tier.close()
    assert sorted(r.outcome.value for r in results) == ["dropped"] * 3 + ["stored"] * 2


def test_put_after_close_fails_once_and_reads_raise(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    tier.open()
    tier.close()
    tier.close()  # idempotent
    done = Outcomes()
    tier.put(PutJob(random_key(), payload(CONTRACT_CHUNK, 0), CONTRACT_CHUNK, "", done))
    assert done.wait(1)[0].outcome is PutOutcome.FAILED
    with pytest.raises(StateError):
        tier.contains([random_key()])
    outs = [(random_key(), torch.zeros(PAGE_BYTES, dtype=torch.uint8)) for _ in range(2)]
    with pytest.raises(StateError):
        tier.get_many_into(outs)


def test_close_drains_queued_writes(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, threads=1)
    tier.open()
    done = Outcomes()
    keys = [random_key() for _ in range(8)]
    for i, key in enumerate(keys):
        tier.put(PutJob(key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK, "", done))
    tier.close()
    assert len(done.results) == 8
    assert {r.outcome for r in done.results} == {PutOutcome.STORED}
    assert len(chunk_files(tmp_path)) == 8 and temp_files(tmp_path) == []


def test_a_write_error_fails_that_chunk_only(tier: DiskTier, tmp_path: Path) -> None:
    kept = random_key()
    put_and_wait(tier, kept, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    bad = random_key()
    # A directory squatting on the final name makes the rename fail (EISDIR).
    (tmp_path / f"{FP.hex()}-{bad.hex()}.kvc").mkdir()
    result = put_and_wait(tier, bad, payload(CONTRACT_CHUNK, 2), CONTRACT_CHUNK)
    assert result.outcome is PutOutcome.FAILED and "disk write failed" in result.detail
    assert tier.counters.failed == 1
    assert tier.contains([kept, bad]) == [True, False]
    assert temp_files(tmp_path) == []
    assert tier.usage().used_bytes == RECORD_BYTES  # the failed reservation was given back
    assert read(tier, kept)[0] == CONTRACT_CHUNK


# -- config ----------------------------------------------------------------------------------
def test_file_urls_and_plain_paths(tmp_path: Path) -> None:
    assert parse_local_disk(f"file://{tmp_path}/a%20b") == f"{tmp_path}/a b"
    assert parse_local_disk(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ConfigError, match="local_disk"):
        parse_local_disk("s3://bucket/dir")


def test_from_config_reads_the_disk_keys(tmp_path: Path) -> None:
    cfg = small_config(
        local_disk=f"file://{tmp_path}/cache",
        max_local_disk_size="1MiB",
        extra_config={"disk_io_threads": 3, "disk_max_inflight_bytes": "64KiB"},
    )
    tier = DiskTier.from_config(cfg, CONTRACT_LAYOUT, FP)
    assert tier.options.path == f"{tmp_path}/cache"
    assert tier.options.capacity_bytes == 1024**2
    assert tier.options.io_threads == 3 and tier.options.max_inflight_bytes == 64 * 1024
    tier.open()  # creates the missing last directory
    tier.close()
    assert (tmp_path / "cache").is_dir()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"max_local_disk_size": "4KiB"}, "max_local_disk_size"),
        ({"extra_config": {"disk_io_threads": 0}}, "extra_config.disk_io_threads"),
        (
            {"extra_config": {"disk_max_inflight_bytes": 100}},
            "extra_config.disk_max_inflight_bytes",
        ),
        (
            {"extra_config": {"disk_max_inflight_bytes": "lots"}},
            "extra_config.disk_max_inflight_bytes",
        ),
    ],
)
def test_bad_disk_config_names_the_key(
    tmp_path: Path, overrides: dict[str, object], key: str
) -> None:
    values: dict[str, object] = {"local_disk": str(tmp_path), "max_local_disk_size": "1MiB"}
    values.update(overrides)
    with pytest.raises(ConfigError) as info:
        DiskTier.from_config(small_config(**values), CONTRACT_LAYOUT, FP)
    assert info.value.key == key


@pytest.mark.parametrize("where", ["parent_is_a_file", "a_file", "read_only_fs"])
def test_unusable_directory_is_a_config_error_naming_the_path(tmp_path: Path, where: str) -> None:
    path = {
        "parent_is_a_file": tmp_path / "file" / "dir",
        "a_file": tmp_path / "file",
        "read_only_fs": Path("/proc/kvtier-test"),  # unwritable even for root
    }[where]
    if where in ("a_file", "parent_is_a_file"):
        (tmp_path / "file").write_bytes(b"")
    tier = make_tier(path)
    with pytest.raises(ConfigError) as info:
        tier.open()
    assert info.value.key == "local_disk" and str(path) in str(info.value)


def test_engine_open_creates_missing_parents_as_lmcache_does(tmp_path: Path) -> None:
    from kvtier import Engine, KVLayout

    missing = tmp_path / "nowhere" / "cache"
    cfg = small_config(local_disk=str(missing), max_local_disk_size="1MiB")
    with Engine(cfg, KVLayout(2, 2, 8, torch.float32), model_name="m") as engine:
        assert engine.tier("disk") is not None
    assert missing.is_dir()


def test_concurrent_puts_reads_pins_and_removes_never_serve_wrong_bytes(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_records=12, threads=3)
    tier.open()
    keys = [random_key() for _ in range(24)]
    errors: list[str] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        for _ in range(150):
            i = int(torch.randint(0, len(keys), (1,), generator=gen))
            op = int(torch.randint(0, 5, (1,), generator=gen))
            key = keys[i]
            if op == 0:
                job = PutJob(key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK, "", lambda r: None)
                tier.put(job)
            elif op == 1 and tier.pin(key):
                tier.unpin(key)
            elif op == 2:
                tier.remove(key)
            else:
                got = tier.get_into(key, out)
                if got is not None and not torch.equal(out, payload(CONTRACT_CHUNK, i)):
                    errors.append(f"wrong bytes for key {i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert tier.flush(10)
        assert errors == []
        assert tier.counters.corrupt == 0
        usage = tier.usage()
        assert usage.used_bytes <= usage.capacity_bytes
        assert usage.entries == len(chunk_files(tmp_path))
        assert temp_files(tmp_path) == []
    finally:
        tier.close()


@pytest.mark.parametrize("offset", [0, READ_BLOCK - 1, READ_BLOCK, 2 * READ_BLOCK + 5, -1])
def test_a_payload_read_in_pieces_is_checked_in_every_piece(tmp_path: Path, offset: int) -> None:
    """A payload of several READ_BLOCK pieces is hashed piece by piece as it lands: it reads
    back exactly, and a flipped byte in any piece (first, at a boundary, the last) is a miss."""
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    chunk = 640  # 2.5 MiB of payload: three pieces
    fingerprint = Fingerprint("pieces", layout, chunk)
    nbytes = layout.chunk_bytes(chunk)
    assert 2 * READ_BLOCK < nbytes < 3 * READ_BLOCK
    options = DiskOptions(str(tmp_path), 4 * (HEADER_SIZE + nbytes), 2, 4 * (HEADER_SIZE + nbytes))
    tier = DiskTier(options, layout, fingerprint)
    tier.open()
    try:
        key = random_key()
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
        put_and_wait(tier, key, data, chunk)
        out = torch.zeros(nbytes, dtype=torch.uint8)
        assert tier.get_into(key, out) == chunk and torch.equal(out, data)
        path = tmp_path / f"{fingerprint.hex()}-{key.hex()}.kvc"
        with open(path, "r+b") as f:
            at = HEADER_SIZE + (offset if offset >= 0 else nbytes - 1)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x80]))
        assert tier.get_into(key, out) is None
        assert tier.counters.corrupt == 1 and not path.exists()
    finally:
        tier.close()


def test_files_evicted_to_make_room_are_reported_to_the_listeners(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_records=2)
    evicted: list[bytes] = []
    tier.add_evict_listener(evicted.extend)
    tier.open()
    try:
        keys = [random_key() for _ in range(3)]
        for i, key in enumerate(keys):
            assert put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK).outcome is (
                PutOutcome.STORED
            )
        assert evicted == [keys[0]] and tier.counters.evicted == 1
        assert tier.contains(keys) == [False, True, True]
    finally:
        tier.close()


# -- files of the previous record format (after an upgrade) ---------------------------------
def test_files_of_format_version_1_are_dropped_at_open_and_on_read_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Records written before the codec slot are misses: a scan removes them with the other
    bad files; read through a saved index that still names them, each is removed and the
    kind is logged once, not per chunk."""
    keys = [random_key() for _ in range(4)]
    tier = make_tier(tmp_path)
    tier.open()
    for i, key in enumerate(keys):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 40 + i), CONTRACT_CHUNK)
    tier.close()  # saves the index: the next open trusts it
    for i, key in enumerate(keys):  # the same names, now holding version 1 records
        path = tmp_path / f"{FP.hex()}-{key.hex()}.kvc"
        path.write_bytes(v1_record(key, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 40 + i)))
    tier = make_tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk.reads"):
        tier.open()
        assert tier.index_checked(10.0)
        for key in keys[:3]:
            assert read(tier, key)[0] is None
    lines = [r for r in caplog.records if "does not read" in r.getMessage()]
    assert len(lines) == 1 and "version 1" in lines[0].getMessage()
    assert tier.counters.corrupt == 3 and len(chunk_files(tmp_path)) == 1
    tier.close()
    os.unlink(tmp_path / f".{FP.hex()}.index")  # no saved index: the open reads headers
    tier = make_tier(tmp_path)
    tier.open()
    try:
        assert tier.counters.bad_removed_at_open == 1 and chunk_files(tmp_path) == []
        assert read(tier, keys[3])[0] is None
    finally:
        tier.close()
