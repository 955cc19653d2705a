"""Payload codecs: the contract over every registered codec, the registry, and the slot used
for real by the disk and redis tiers.

Two test-only codecs prove the slot carries a codec other than identity: ``test-xor`` (same
length, every byte changed) and ``test-zlib`` (another stored length, so the header's stored
length, the file size, the index and the redis value all differ from the payload's). They
are registered for each test that uses them and taken back after.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config.remote_url import parse_remote_url
from kvtier.errors import CorruptRecord
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage import codecs, record_reads, records
from kvtier.storage.base import PutOutcome
from kvtier.storage.codecs import IDENTITY, PayloadCodec
from kvtier.storage.disk import files
from kvtier.storage.disk.snapshot import snapshot_name
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.redis import wire
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tier import RedisTier
from tests.redis_servers import RedisServer
from tests.storage.codec_contract import CodecContract, address, kv_payload
from tests.storage.disk.disk_helpers import FP, RECORD_BYTES, chunk_files, make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)


class XorCodec(PayloadCodec):
    """Test only: every byte XOR 0x5A (the stored bytes are the payload's length)."""

    codec_id = 0xFF01
    name = "test-xor"

    def encode(self, payload: memoryview, layout: KVLayout) -> bytes:
        return (np.frombuffer(payload, dtype=np.uint8) ^ 0x5A).tobytes()

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        n = min(stored.nbytes, out.nbytes)
        np.frombuffer(out, dtype=np.uint8)[:n] = np.frombuffer(stored, dtype=np.uint8)[:n] ^ 0x5A
        return n


class ZlibCodec(PayloadCodec):
    """Test only: zlib level 1 (the stored length differs from the payload's)."""

    codec_id = 0xFF02
    name = "test-zlib"

    def encode(self, payload: memoryview, layout: KVLayout) -> bytes:
        return zlib.compress(payload, 1)

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(stored, out.nbytes + 1)
        except zlib.error as exc:
            raise CorruptRecord(f"zlib: {exc}") from None
        if not inflater.eof:
            raise CorruptRecord("zlib stream cut short")
        out[: len(data)] = data
        return len(data)


XOR, ZLIB = XorCodec(), ZlibCodec()
TEST_CODECS = (XOR, ZLIB)


@pytest.fixture
def test_codecs() -> Iterator[None]:
    """The test-only codecs registered for one test."""
    for codec in TEST_CODECS:
        codecs.register(codec)
    try:
        yield
    finally:
        for codec in TEST_CODECS:
            codecs.unregister(codec.codec_id)


# -- the contract, over every registered codec and the test-only ones -----------------------
CODEC_NAMES = sorted({c.name for c in codecs.registered()} | {c.name for c in TEST_CODECS})


class TestEveryCodec(CodecContract):
    @pytest.fixture(params=CODEC_NAMES)
    def codec(self, request: pytest.FixtureRequest, test_codecs: None) -> PayloadCodec:
        found = codecs.codec_by_name(request.param)
        assert found is not None
        return found


# -- the registry and the record's checks around a codec ------------------------------------
def test_identity_is_id_0_and_always_registered() -> None:
    assert codecs.codec_by_id(0) is IDENTITY and codecs.codec_by_name("identity") is IDENTITY
    assert IDENTITY.is_identity and IDENTITY.lossless
    with pytest.raises(ValueError, match="identity"):
        codecs.unregister(0)


def test_registry_finds_codecs_by_id_and_name_and_refuses_clashes(test_codecs: None) -> None:
    assert codecs.codec_by_id(ZLIB.codec_id) is ZLIB
    assert codecs.codec_by_name("test-xor") is XOR
    assert [c.codec_id for c in codecs.registered()] == sorted(
        c.codec_id for c in codecs.registered()
    )
    codecs.register(ZLIB)  # the same codec again: a no-op
    same_id = type("SameId", (XorCodec,), {"name": "other"})()
    same_name = type("SameName", (XorCodec,), {"codec_id": 7})()
    for clash in (same_id, same_name):
        with pytest.raises(ValueError, match="clashes"):
            codecs.register(clash)
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        codecs.register(type("TooBig", (XorCodec,), {"codec_id": 1 << 16, "name": "big"})())
    assert codecs.codec_by_id(7) is None and codecs.codec_by_name("other") is None


def test_a_writer_refuses_a_codec_no_reader_could_find() -> None:
    fp = Fingerprint("m", CONTRACT_LAYOUT, CONTRACT_CHUNK)
    with pytest.raises(ValueError, match="not registered"):
        records.encode_parts(random_key(), fp, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 1), XOR)


class ShortCodec(XorCodec):
    """Decodes one byte less than the payload: a broken codec."""

    codec_id = 0xFF03
    name = "test-short"

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        return super().decode(stored, out, layout) - 1


def test_a_decoded_length_other_than_the_payload_length_is_a_miss() -> None:
    short = ShortCodec()
    codecs.register(short)
    try:
        fp = Fingerprint("m", CONTRACT_LAYOUT, CONTRACT_CHUNK)
        key = random_key()
        record = records.encode_record(key, fp, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 2), short)
        with pytest.raises(CorruptRecord, match="decoded"):
            record_reads.decode_record_into(
                record, fp, key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            )
    finally:
        codecs.unregister(short.codec_id)


# -- identity adds no copy: the read lands in the caller's page -----------------------------
@pytest.fixture
def identity_decode_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any call of the identity codec's decode is a copy the streamed reads must not make."""

    def forbidden(*_: object) -> int:
        raise AssertionError("identity decode called: the payload was copied into the page")

    monkeypatch.setattr(IDENTITY, "decode", forbidden)


def _landed_in(page: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[int, int]:
    """Bytes of ``spans`` (address, length) inside ``page``'s memory, and outside it."""
    lo, hi = page.data_ptr(), page.data_ptr() + page.numel()
    inside = sum(n for at, n in spans if lo <= at and at + n <= hi)
    return inside, sum(n for _, n in spans) - inside


@pytest.mark.parametrize("codec", [IDENTITY, ZLIB], ids=["identity", "zlib"])
def test_a_disk_read_lands_identity_bytes_in_the_page_and_only_there(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    test_codecs: None,
    identity_decode_forbidden: None,
    codec: PayloadCodec,
) -> None:
    """Every byte preadv reads after the header goes into the caller's page for identity;
    none does for zlib (read into scratch, then decoded): the check can tell them apart."""
    tier = make_tier(tmp_path, codec=codec)
    tier.open()
    try:
        key, data = random_key(), payload(CONTRACT_CHUNK, 5)
        put_and_wait(tier, key, data, CONTRACT_CHUNK)
        spans: list[tuple[int, int]] = []
        real = os.preadv

        def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
            if offset >= records.HEADER_SIZE:
                spans.extend((address(b), b.nbytes) for b in buffers)
            return real(fd, buffers, offset)

        monkeypatch.setattr(files.os, "preadv", spy)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        assert torch.equal(out, data)
        inside, outside = _landed_in(out, spans)
        stored = (tmp_path / chunk_files(tmp_path)[0]).stat().st_size - records.HEADER_SIZE
        assert (inside, outside) == ((stored, 0) if codec.is_identity else (0, stored))
    finally:
        tier.close()


@pytest.mark.parametrize("codec", [IDENTITY, ZLIB], ids=["identity", "zlib"])
def test_a_redis_read_lands_identity_bytes_in_the_page_and_only_there(
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    test_codecs: None,
    identity_decode_forbidden: None,
    codec: PayloadCodec,
) -> None:
    tier = open_redis_tier(redis_server, codec)
    try:
        key, data = random_key(), payload(CONTRACT_CHUNK, 6)
        put_and_wait(tier, key, data, CONTRACT_CHUNK)
        spans: list[tuple[int, int]] = []
        real = wire._ReplyReader.readinto

        def spy(self: object, dest: memoryview, on_piece: object = None) -> None:
            if dest.nbytes > records.HEADER_SIZE or on_piece is not None:  # the stored bytes
                spans.append((address(dest), dest.nbytes))
            real(self, dest, on_piece)  # type: ignore[arg-type]

        monkeypatch.setattr(wire._ReplyReader, "readinto", spy)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        assert torch.equal(out, data)
        with redis_server.client() as raw:
            stored = raw.strlen(tier.store.name_of(key)) - records.HEADER_SIZE
        inside, outside = _landed_in(out, spans)
        assert (inside, outside) == ((stored, 0) if codec.is_identity else (0, stored))
    finally:
        tier.clear()
        tier.close()


# -- a non-identity codec through the disk tier ---------------------------------------------
def compressible(num_tokens: int) -> torch.Tensor:
    """KV-shaped fp32 bytes zlib shrinks."""
    values = kv_payload(CONTRACT_LAYOUT, num_tokens, 7).view(torch.float32)
    return values.round().view(torch.uint8)  # small integers: highly compressible


class TestDiskTierWithZlib(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path, test_codecs: None) -> Iterator[DiskTier]:
        tier = make_tier(tmp_path, codec=ZLIB)
        tier.open()
        yield tier
        tier.close()


def test_a_zlib_file_names_its_codec_counts_its_stored_size_and_survives_a_restart(
    tmp_path: Path, test_codecs: None
) -> None:
    key, data = random_key(), compressible(CONTRACT_CHUNK)
    tier = make_tier(tmp_path, codec=ZLIB)
    tier.open()
    assert put_and_wait(tier, key, data, CONTRACT_CHUNK).outcome is PutOutcome.STORED
    path = tmp_path / chunk_files(tmp_path)[0]
    raw = path.read_bytes()
    header = records.decode_header(raw, FP, key)
    assert header.codec is ZLIB and header.payload_len == data.numel()
    assert len(raw) == header.record_len < RECORD_BYTES  # the stored bytes are smaller
    assert tier.usage().used_bytes == len(raw)  # the index counts what the file holds
    tier.close()
    # Reopened by a tier that writes identity: it reads zlib records all the same, from
    # the saved index and from a scan of the headers.
    for saved_index in (True, False):
        if not saved_index:
            os.unlink(tmp_path / snapshot_name(FP.hex()))
        again = make_tier(tmp_path)
        again.open()
        try:
            assert again.index_checked(10.0)
            assert again.usage().used_bytes == len(raw)
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert again.get_into(key, out) == CONTRACT_CHUNK
            assert torch.equal(out, data)
        finally:
            again.close()


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_corrupt_zlib_file_is_a_miss_and_removed(
    tmp_path: Path, test_codecs: None, where: str
) -> None:
    tier = make_tier(tmp_path, codec=ZLIB)
    tier.open()
    try:
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 8), CONTRACT_CHUNK)
        path = tmp_path / chunk_files(tmp_path)[0]
        raw = bytearray(path.read_bytes())
        raw[records.HEADER_SIZE if where == "first" else -1] ^= 0x01
        path.write_bytes(raw)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) is None
        assert not bool(out.any())  # caught on the stored bytes: nothing decoded
        assert tier.counters.corrupt == 1 and not path.exists()
        assert "checksum" in (tier.corruption(key) or "")
    finally:
        tier.close()


def test_a_disk_file_of_a_codec_this_process_lacks_is_dropped_once_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [random_key() for _ in range(3)]
    codecs.register(ZLIB)
    try:
        tier = make_tier(tmp_path, codec=ZLIB)
        tier.open()
        for i, key in enumerate(keys):
            put_and_wait(tier, key, payload(CONTRACT_CHUNK, 20 + i), CONTRACT_CHUNK)
    finally:
        codecs.unregister(ZLIB.codec_id)
    # Read while open (the index names them): each is a miss and removed, one log line.
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk.reads"):
        for key in keys[:2]:
            assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None
    lines = [r for r in caplog.records if "format this kvtier does not read" in r.getMessage()]
    assert len(lines) == 1 and f"codec id {ZLIB.codec_id}" in lines[0].getMessage()
    assert tier.counters.corrupt == 2
    tier.close()
    # A scan at the next open drops the last one with the other bad files.
    os.unlink(tmp_path / snapshot_name(FP.hex()))
    again = make_tier(tmp_path)
    again.open()
    try:
        assert again.counters.bad_removed_at_open == 1 and chunk_files(tmp_path) == []
    finally:
        again.close()


# -- a non-identity codec through the redis tier --------------------------------------------
def open_redis_tier(server: RedisServer, codec: PayloadCodec = IDENTITY) -> RedisTier:
    fp = Fingerprint("codec-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
    options = RedisOptions(timeout_s=2.0)
    tier = RedisTier(parse_remote_url(server.url), fp.layout, fp, options, codec)
    tier.open()
    return tier


class TestRedisTierWithZlib(TierContract):
    @pytest.fixture
    def tier(self, redis_server: RedisServer, test_codecs: None) -> Iterator[RedisTier]:
        tier = open_redis_tier(redis_server, ZLIB)
        yield tier
        tier.clear()
        tier.close()


def test_a_zlib_redis_value_is_read_by_any_tier_and_corruption_is_a_miss(
    redis_server: RedisServer, test_codecs: None
) -> None:
    writer, reader = open_redis_tier(redis_server, ZLIB), open_redis_tier(redis_server)
    try:
        key, data = random_key(), compressible(CONTRACT_CHUNK)
        put_and_wait(writer, key, data, CONTRACT_CHUNK)
        name = writer.store.name_of(key)
        with redis_server.client() as raw:
            value = raw.get(name)
        header = records.decode_header(value, writer.fingerprint, key)
        assert header.codec is ZLIB and len(value) == header.record_len < RECORD_BYTES
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert reader.get_into(key, out) == CONTRACT_CHUNK  # an identity writer reads it
        assert torch.equal(out, data)
        with redis_server.client() as raw:
            raw.setrange(name, len(value) - 1, bytes([value[-1] ^ 0x01]))
        out.zero_()
        assert reader.get_into(key, out) is None and not bool(out.any())
        assert reader.counters.corrupt == 1
        with redis_server.client() as raw:
            assert raw.exists(name) == 0  # a corrupt record is deleted
    finally:
        for tier in (writer, reader):
            tier.clear()
            tier.close()


def test_a_redis_value_of_a_codec_this_process_lacks_is_a_miss_and_kept(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    codecs.register(XOR)
    try:
        writer = open_redis_tier(redis_server, XOR)
        key = random_key()
        put_and_wait(writer, key, payload(CONTRACT_CHUNK, 9), CONTRACT_CHUNK)
        writer.close()
    finally:
        codecs.unregister(XOR.codec_id)
    reader = open_redis_tier(redis_server)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.redis.store"):
            for _ in range(2):
                out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
                assert reader.get_into(key, out) is None
        lines = [r for r in caplog.records if "does not read" in r.getMessage()]
        assert len(lines) == 1 and f"codec id {XOR.codec_id}" in lines[0].getMessage()
        assert reader.counters.corrupt == 0 and reader.counters.misses == 2
        assert reader.contains([key]) == [True]  # kept: another engine may read it
    finally:
        reader.clear()
        reader.close()
