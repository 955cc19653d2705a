"""A record's codec is bound to its fingerprint: a disk tier never serves a record of another
codec, even one whose header names the tier's own fingerprint (someone with write access to
the directory, or a bug, put it there). It is a corrupt miss: logged, counted, removed.

The forged records are a real tier's records with the fingerprint digest of the header
rewritten to the reader's and the header checksum made to match: everything but the codec
binding checks out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.fingerprint import KEY_BYTES, Fingerprint
from kvtier.storage import records
from kvtier.storage.codecs import FP8, IDENTITY, INT8, PayloadCodec, tier_fingerprint
from kvtier.storage.disk.tier import DiskTier
from tests.storage.disk.disk_helpers import FP, make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    put_and_wait,
    random_key,
)

FINGERPRINT_AT, HASHED, HEADER_HASH_AT = 28, 114, 114


def kv_page(seed: int) -> torch.Tensor:
    """A page of real float KV (a lossy codec rounds it; random bytes may be NaNs)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(PAGE_BYTES // 4, generator=gen, dtype=torch.float32)
    assert CONTRACT_LAYOUT.dtype == torch.float32
    return kv.view(torch.uint8)


def chunk_file(tier: DiskTier, key: bytes) -> Path:
    return Path(tier.options.path) / f"{tier.fingerprint.hex()}-{key.hex()}.kvc"


def written_by(tmp_path: Path, codec: PayloadCodec, key: bytes, page: torch.Tensor) -> bytes:
    """The file a tier writing with ``codec`` makes of ``page``."""
    writer = make_tier(tmp_path / codec.name, codec=codec)
    writer.open()
    try:
        put_and_wait(writer, key, page, CONTRACT_CHUNK)
        return chunk_file(writer, key).read_bytes()
    finally:
        writer.close()


def forged_for(record: bytes, reader: Fingerprint) -> bytes:
    """``record`` claiming ``reader``'s fingerprint, its header checksum recomputed."""
    forged = bytearray(record)
    forged[FINGERPRINT_AT : FINGERPRINT_AT + KEY_BYTES] = reader.digest()[:KEY_BYTES]
    forged[HEADER_HASH_AT : HEADER_HASH_AT + 8] = xxhash.xxh3_64_intdigest(
        bytes(forged[:HASHED])
    ).to_bytes(8, "little")
    return bytes(forged)


def read(tier: DiskTier, key: bytes) -> int | None:
    return tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("reader_codec", "writer_codec"),
    [(IDENTITY, FP8), (FP8, INT8), (FP8, IDENTITY)],
    ids=["exact-reader-fp8-record", "fp8-reader-int8-record", "fp8-reader-exact-record"],
)
def test_a_record_of_another_codec_under_the_readers_fingerprint_is_a_logged_miss(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    reader_codec: PayloadCodec,
    writer_codec: PayloadCodec,
) -> None:
    key, page = random_key(), kv_page(7)
    reader = make_tier(tmp_path / "reader", codec=reader_codec)
    reader.open()
    put_and_wait(reader, key, page, CONTRACT_CHUNK)  # the reader's index names the chunk
    own = chunk_file(reader, key)
    reader.close()  # saves the index: the next open trusts it and reads no header
    other = written_by(tmp_path, writer_codec, key, page)
    own.write_bytes(forged_for(other, reader.fingerprint))

    reader = make_tier(tmp_path / "reader", codec=reader_codec)
    reader.open()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
            assert read(reader, key) is None
        assert reader.counters.corrupt == 1 and not own.exists()
        (line,) = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
        assert f"codec {writer_codec.name!r} is not its fingerprint's codec" in line
    finally:
        reader.close()


def test_the_open_scan_drops_a_record_of_another_codec(tmp_path: Path) -> None:
    """Without a saved index the open reads every header: the forged file is not indexed."""
    key = random_key()
    forged = forged_for(written_by(tmp_path, FP8, key, kv_page(3)), FP)
    reader = make_tier(tmp_path / "reader")
    os.makedirs(reader.options.path)
    chunk_file(reader, key).write_bytes(forged)
    reader.open()
    try:
        assert reader.index_checked(10.0)
        assert reader.contains([key]) == [False] and read(reader, key) is None
    finally:
        reader.close()


def test_the_readers_own_codec_is_still_a_hit(tmp_path: Path) -> None:
    for codec in (IDENTITY, FP8, INT8):
        tier = make_tier(tmp_path / codec.name, codec=codec)
        tier.open()
        try:
            key = random_key()
            put_and_wait(tier, key, kv_page(5), CONTRACT_CHUNK)
            assert read(tier, key) == CONTRACT_CHUNK
        finally:
            tier.close()


def test_a_writer_refuses_a_codec_its_fingerprint_does_not_name() -> None:
    """What the reader refuses, no writer makes: records come from tier_fingerprint()."""
    with pytest.raises(ValueError, match="not its fingerprint's codec"):
        records.encode_parts(random_key(), FP, CONTRACT_CHUNK, kv_page(1), FP8)
    with pytest.raises(ValueError, match="not its fingerprint's codec"):
        records.encode_parts(
            random_key(), tier_fingerprint(FP, INT8), CONTRACT_CHUNK, kv_page(1), FP8
        )
