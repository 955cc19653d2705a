from __future__ import annotations

import dataclasses
import itertools
import os
import struct

import pytest
import torch

from kvtier.errors import CorruptRecord, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage import records
from kvtier.storage.record_reads import decode_record_into, payload_hasher, verify_stored
from kvtier.storage.records import (
    HEADER_SIZE,
    RECORD_MAGIC,
    decode_header,
    encode_header,
    encode_record,
    header_size,
    payload_checksum,
)
from tests.storage.tier_contract import CONTRACT_CHUNK, CONTRACT_LAYOUT, PAGE_BYTES, payload

FP = Fingerprint("test-model", CONTRACT_LAYOUT, CONTRACT_CHUNK)
KEY = bytes(range(16))


def v1_record(key: bytes, fp: Fingerprint, num_tokens: int, data: torch.Tensor) -> bytes:
    """A record exactly as format version 1 wrote it (kvtier before the codec slot): no codec
    id or stored length, the payload checksum at 88, the header checksum of bytes 0..104."""
    import xxhash

    from kvtier.layout import dtype_name

    lay = fp.layout
    body = data.numpy().tobytes()
    fields = struct.pack(
        "<8sHH16s16sIII16sIIQ16s",
        RECORD_MAGIC,
        1,
        HEADER_SIZE,
        key,
        fp.digest()[:16].ljust(16, b"\0"),
        lay.num_layers,
        lay.num_kv_heads,
        lay.head_dim,
        dtype_name(lay.dtype).encode("ascii"),
        fp.chunk_size,
        num_tokens,
        len(body),
        bytes(xxhash.xxh3_128_digest(body)),
    )
    head = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    return head + bytes(HEADER_SIZE - len(head)) + body


def test_a_record_of_format_version_1_is_an_unknown_format_miss() -> None:
    """Files written before the codec slot: refused as another format (logged once by the
    tiers), never misread with the fields moved."""
    record = v1_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 12))
    with pytest.raises(UnknownRecordFormat, match="version 1, this kvtier reads 2"):
        decode_header(record, FP, KEY)
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    with pytest.raises(CorruptRecord):
        decode_record_into(record, FP, KEY, out)
    assert not bool(out.any())


def test_round_trip_in_memory() -> None:
    data = payload(CONTRACT_CHUNK, 1)
    record = encode_record(KEY, FP, CONTRACT_CHUNK, data)
    assert len(record) == header_size() + data.numel()
    assert record.startswith(RECORD_MAGIC)
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert decode_record_into(record, FP, KEY, out) == CONTRACT_CHUNK
    assert torch.equal(out, data)


def test_partial_chunk_round_trips_and_header_describes_it() -> None:
    data = payload(3, 2)
    record = encode_record(KEY, FP, 3, data)
    header = decode_header(record, FP, None)
    assert (header.key, header.num_tokens, header.payload_len) == (KEY, 3, data.numel())
    verify_stored(header, memoryview(record)[HEADER_SIZE:])
    out = torch.full((PAGE_BYTES,), 7, dtype=torch.uint8)
    assert decode_record_into(memoryview(record), FP, KEY, out) == 3
    assert torch.equal(out[: data.numel()], data)
    assert bool((out[data.numel() :] == 7).all())  # nothing past the payload is written


def test_header_is_page_aligned_for_odirect() -> None:
    assert header_size() % 4096 == 0


# Every header field, by its offset and size (see the table in records.py).
FIELDS = {
    "magic": (0, 8),
    "version": (8, 2),
    "header_size": (10, 2),
    "key": (12, 16),
    "fingerprint": (28, 16),
    "num_layers": (44, 4),
    "num_kv_heads": (48, 4),
    "head_dim": (52, 4),
    "dtype": (56, 16),
    "chunk_size": (72, 4),
    "num_tokens": (76, 4),
    "payload_len": (80, 8),
    "codec_id": (88, 2),
    "stored_len": (90, 8),
    "stored_checksum": (98, 16),
    "header_checksum": (114, 8),
}


def test_the_field_table_covers_every_hashed_header_byte() -> None:
    spans = sorted(FIELDS.values())
    assert spans[0][0] == 0
    for (at, size), (nxt, _) in itertools.pairwise(spans):
        assert at + size == nxt  # no gap, no overlap
    assert spans[-1][0] + spans[-1][1] == records._PARTS_AT  # where the part block starts


def test_the_header_names_format_version_codec_and_stored_length() -> None:
    data = payload(CONTRACT_CHUNK, 11)
    record = encode_record(KEY, FP, CONTRACT_CHUNK, data)
    assert records.RECORD_VERSION == 2
    assert struct.unpack_from("<H", record, FIELDS["version"][0]) == (2,)
    assert struct.unpack_from("<H", record, FIELDS["codec_id"][0]) == (0,)  # identity
    assert struct.unpack_from("<Q", record, FIELDS["stored_len"][0]) == (data.numel(),)
    assert struct.unpack_from("<Q", record, FIELDS["payload_len"][0]) == (data.numel(),)


@pytest.mark.parametrize("field", FIELDS)
def test_every_corrupted_header_field_is_refused(field: str) -> None:
    record = bytearray(encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 3)))
    offset, size = FIELDS[field]
    record[offset + size // 2] ^= 0x01
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    with pytest.raises(CorruptRecord):
        decode_record_into(record, FP, KEY, out)
    assert not bool(out.any())  # a refused record writes nothing


def test_a_consistently_rewritten_header_is_still_checked_against_the_fingerprint() -> None:
    """Someone rewrote fields and fixed the header checksum: the semantic checks still hold."""
    import xxhash

    record = bytearray(encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 4)))
    struct.pack_into("<I", record, 76, CONTRACT_CHUNK - 1)  # num_tokens no longer fits payload_len
    struct.pack_into("<Q", record, 114, xxhash.xxh3_64_intdigest(bytes(record[:114])))
    with pytest.raises(CorruptRecord, match="payload length"):
        decode_header(record, FP, KEY)


def test_other_fingerprints_and_layouts_are_refused() -> None:
    record = encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 5))
    other_model = dataclasses.replace(FP, model_name="other")
    other_rank = dataclasses.replace(FP, tp_rank=1, tp_world_size=2)
    other_layout = dataclasses.replace(FP, layout=KVLayout(2, 2, 8, torch.float16))
    for fp in (other_model, other_rank, other_layout):
        with pytest.raises(CorruptRecord):
            decode_header(record, fp, KEY)


def test_wrong_expected_key_is_refused() -> None:
    record = encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 6))
    with pytest.raises(CorruptRecord, match="key"):
        decode_header(record, FP, os.urandom(16))


@pytest.mark.parametrize("position", [0, 1, PAGE_BYTES // 2, PAGE_BYTES - 1])
def test_bit_flip_in_payload_is_detected(position: int) -> None:
    record = bytearray(encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 7)))
    record[HEADER_SIZE + position] ^= 0x10
    header = decode_header(record, FP, KEY)  # the header alone is intact
    with pytest.raises(CorruptRecord, match="checksum"):
        verify_stored(header, memoryview(record)[HEADER_SIZE:])
    with pytest.raises(CorruptRecord):
        decode_record_into(record, FP, KEY, torch.zeros(PAGE_BYTES, dtype=torch.uint8))


@pytest.mark.parametrize("length", [0, 10, 121, HEADER_SIZE, HEADER_SIZE + PAGE_BYTES - 1])
def test_truncated_records_are_refused(length: int) -> None:
    record = encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 8))
    with pytest.raises(CorruptRecord):
        decode_record_into(record[:length], FP, KEY, torch.zeros(PAGE_BYTES, dtype=torch.uint8))


def test_trailing_bytes_are_refused() -> None:
    record = encode_record(KEY, FP, CONTRACT_CHUNK, payload(CONTRACT_CHUNK, 9)) + b"x"
    with pytest.raises(CorruptRecord, match="bytes"):
        decode_record_into(record, FP, KEY, torch.zeros(PAGE_BYTES, dtype=torch.uint8))


def test_encode_refuses_a_payload_that_does_not_match_its_token_count() -> None:
    with pytest.raises(ValueError, match="payload"):
        encode_header(KEY, FP, 4, payload(5, 1))
    with pytest.raises(ValueError, match="num_tokens"):
        encode_header(KEY, FP, CONTRACT_CHUNK + 1, payload(CONTRACT_CHUNK + 1, 1))


def test_checksum_reads_tensor_memory_without_a_copy() -> None:
    data = payload(CONTRACT_CHUNK, 10)
    assert records.payload_checksum(data) == records.payload_checksum(data.numpy().tobytes())


def test_a_streamed_checksum_in_any_pieces_equals_the_whole_payload_checksum() -> None:
    data = payload(CONTRACT_CHUNK, 3)
    view = memoryview(data.numpy())
    for piece in (1, 7, 4096, view.nbytes):
        hasher = payload_hasher()
        for start in range(0, view.nbytes, piece):
            hasher.update(view[start : start + piece])
        assert hasher.digest() == payload_checksum(data)
