"""The disk and redis tiers writing with each of kvtier's codecs.

Lossless codecs pass the whole tier contract (random bytes round trip exactly). Lossy codecs
cannot (random bytes are no KV: NaN patterns included), so they are held to what a tier
promises with them: KV comes back within the codec's error, the record names the codec and
stores fewer bytes (the index and the server count those), and a tier configured with
another codec never reads the chunk, while the same codec config reads it after a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config.remote_url import parse_remote_url
from kvtier.fingerprint import Fingerprint
from kvtier.storage import records
from kvtier.storage.codecs import FP8, IDENTITY, INT8, LOSSLESS, PayloadCodec
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tier import RedisTier
from tests.redis_servers import RedisServer
from tests.storage.codec_contract import assert_close_kv, kv_payload
from tests.storage.disk.disk_helpers import RECORD_BYTES, chunk_files, make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    TierContract,
    put_and_wait,
    random_key,
)

CODECS = {c.name: c for c in (LOSSLESS, FP8, INT8)}


def redis_tier(server: RedisServer, codec: PayloadCodec = IDENTITY) -> RedisTier:
    fp = Fingerprint("codec-tiers", CONTRACT_LAYOUT, CONTRACT_CHUNK)
    tier = RedisTier(
        parse_remote_url(server.url), fp.layout, fp, RedisOptions(timeout_s=2.0), codec
    )
    tier.open()
    return tier


def check_read(codec: PayloadCodec, data: torch.Tensor, out: torch.Tensor) -> None:
    if codec.lossless:
        assert torch.equal(out, data)
    else:
        assert_close_kv(CONTRACT_LAYOUT, CONTRACT_CHUNK, data, out)


class TestDiskTierLossless(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[DiskTier]:
        tier = make_tier(tmp_path, codec=LOSSLESS)
        tier.open()
        yield tier
        tier.close()


class TestRedisTierLossless(TierContract):
    @pytest.fixture
    def tier(self, redis_server: RedisServer) -> Iterator[RedisTier]:
        tier = redis_tier(redis_server, LOSSLESS)
        yield tier
        tier.clear()
        tier.close()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_disk_tier_stores_fewer_bytes_and_only_its_codec_config_reads_a_lossy_chunk(
    tmp_path: Path, name: str
) -> None:
    codec = CODECS[name]
    key, data = random_key(), kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 11)
    writer = make_tier(tmp_path, codec=codec)
    writer.open()
    try:
        put_and_wait(writer, key, data, CONTRACT_CHUNK)
        raw = (tmp_path / chunk_files(tmp_path)[0]).read_bytes()
        header = records.decode_header(raw, writer.fingerprint, key)
        assert header.codec is codec and len(raw) < RECORD_BYTES
        assert writer.usage().used_bytes == len(raw)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert writer.get_into(key, out) == CONTRACT_CHUNK
        check_read(codec, data, out)
    finally:
        writer.close()
    for reader_codec in (codec, IDENTITY):  # after a restart: the same config, then another
        reader = make_tier(tmp_path, codec=reader_codec)
        reader.open()
        try:
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            found = reader.get_into(key, out)
            if reader_codec is codec or codec.lossless:
                assert found == CONTRACT_CHUNK
                check_read(codec, data, out)
            else:  # another cache: not even looked at (its own namespace)
                assert found is None and reader.contains([key]) == [False]
                assert reader.counters.corrupt == 0
        finally:
            reader.close()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_redis_tier_stores_fewer_bytes_and_only_its_codec_config_reads_a_lossy_chunk(
    redis_server: RedisServer, name: str
) -> None:
    codec = CODECS[name]
    writer, same, other = (redis_tier(redis_server, c) for c in (codec, codec, IDENTITY))
    try:
        key, data = random_key(), kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 12)
        put_and_wait(writer, key, data, CONTRACT_CHUNK)
        with redis_server.client() as raw:
            value = raw.get(writer.store.name_of(key))
        header = records.decode_header(value, writer.fingerprint, key)
        assert header.codec is codec and len(value) < RECORD_BYTES
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert same.get_into(key, out) == CONTRACT_CHUNK
        check_read(codec, data, out)
        out.zero_()
        if codec.lossless:  # any reader decodes it: same keys, same names
            assert other.get_into(key, out) == CONTRACT_CHUNK and torch.equal(out, data)
        else:
            assert other.store.name_of(key) != writer.store.name_of(key)
            assert other.get_into(key, out) is None and not bool(out.any())
            assert other.contains([key]) == [False]
    finally:
        for tier in (writer, same, other):
            tier.clear()
            tier.close()
