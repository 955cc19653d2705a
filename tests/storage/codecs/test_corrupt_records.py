"""A coded record damaged while nobody was running, read after a restart: a miss, counted and
removed, never data; its neighbours still read back. On disk with the saved index intact
(the index names the file, so only the payload checksum can catch it) and with the index
damaged too (every header read again at open); in Redis by a tier instance of a new process's
kind (nothing of the writer's left in memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.storage import records
from kvtier.storage.codecs import FP8, INT8, LOSSLESS, PayloadCodec
from kvtier.storage.disk import files
from tests.redis_servers import RedisServer
from tests.storage.codec_contract import assert_close_kv, kv_payload
from tests.storage.codecs.test_tiers import redis_tier
from tests.storage.disk.disk_helpers import make_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    put_and_wait,
    random_key,
)

CODECS = {c.name: c for c in (LOSSLESS, FP8, INT8)}


def flip_payload_byte(record: bytes) -> bytes:
    """One bit of the coded payload (past the header), in its middle."""
    at = records.HEADER_SIZE + (len(record) - records.HEADER_SIZE) // 2
    return record[:at] + bytes([record[at] ^ 0x04]) + record[at + 1 :]


def read_back(codec: PayloadCodec, data: torch.Tensor, out: torch.Tensor) -> None:
    if codec.lossless:
        assert torch.equal(out, data)
    else:
        assert_close_kv(CONTRACT_LAYOUT, CONTRACT_CHUNK, data, out)


@pytest.mark.parametrize("index", ["saved", "damaged"])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_coded_disk_record_damaged_while_closed_is_a_miss_after_a_restart(
    tmp_path: Path, name: str, index: str
) -> None:
    codec = CODECS[name]
    keys = [random_key(), random_key()]
    data = [kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 21 + i) for i in range(2)]
    writer = make_tier(tmp_path, codec=codec)
    writer.open()
    for key, payload in zip(keys, data, strict=True):
        put_and_wait(writer, key, payload, CONTRACT_CHUNK)
    writer.close()  # a clean close: the index is saved
    damaged = tmp_path / files.final_name(writer.fp_hex, keys[0])  # its codec's namespace
    index_file = tmp_path / f".{writer.fp_hex}.index"
    assert index_file.exists()
    damaged.write_bytes(flip_payload_byte(damaged.read_bytes()))
    if index == "damaged":
        index_file.write_bytes(index_file.read_bytes()[:-5])  # torn: ignored, headers read
    reader = make_tier(tmp_path, codec=codec)
    reader.open()
    try:
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert reader.get_into(keys[0], out) is None
        assert reader.counters.corrupt == 1 and not damaged.exists()
        assert reader.contains(keys) == [False, True]
        assert reader.get_into(keys[1], out) == CONTRACT_CHUNK
        read_back(codec, data[1], out)
    finally:
        reader.close()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_coded_redis_record_damaged_in_redis_is_a_miss_for_a_new_reader(
    redis_server: RedisServer, name: str
) -> None:
    codec = CODECS[name]
    keys = [random_key(), random_key()]
    data = [kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 31 + i) for i in range(2)]
    writer = redis_tier(redis_server, codec)
    try:
        for key, payload in zip(keys, data, strict=True):
            put_and_wait(writer, key, payload, CONTRACT_CHUNK)
    finally:
        writer.close()
    reader = redis_tier(redis_server, codec)
    try:
        with redis_server.client() as raw:
            stored = raw.get(reader.store.name_of(keys[0]))
            raw.set(reader.store.name_of(keys[0]), flip_payload_byte(stored))
            out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert reader.get_into(keys[0], out) is None
            assert reader.counters.corrupt == 1
            assert raw.exists(reader.store.name_of(keys[0])) == 0  # deleted, not served again
        assert reader.get_into(keys[1], out) == CONTRACT_CHUNK
        read_back(codec, data[1], out)
    finally:
        reader.clear()
        reader.close()
