"""The contract every payload codec passes (kvtier.storage.codecs).

A codec's test module subclasses :class:`CodecContract` and provides a ``codec`` fixture that
yields a codec registered for the test's duration (``tests/storage/test_codecs.py`` runs it
over every registered codec and its test-only ones). Every test here goes through the record
format (``kvtier.storage.records``), as the disk and redis tiers do::

    page --encode--> stored bytes --checksum--> header      a writer
    header --codec id--> codec; stored --checksum--> decode --length--> page     a reader

What it holds a codec to: payloads of several layouts, dtypes and token counts come back as
they went in (byte for byte when the codec says ``lossless``); the header names the codec and
the stored length; a lossy codec's page comes back within a bounded error, its state layers
byte for byte, and it runs under a fingerprint of its own; a corrupt stored byte is a miss
before the codec sees it, never data; a reader that does not know the codec's id misses,
clearly; ``encode`` leaves the page alone; ``decode`` of a cut stored stream never claims the
whole payload; and only the identity codec's stored bytes are the page itself.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash

from kvtier.errors import CorruptRecord, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.layout import GroupKind, KVGroup, KVLayout
from kvtier.storage import codecs, record_reads, records
from kvtier.storage.codecs import PayloadCodec, tier_fingerprint

# (name, layout, chunk size): fp32 and bf16 pages, a page made of group parts (a trimmed
# sliding-window group) whose identity records carry part checksums, and a page whose last
# layer carries a recurrent state (which a lossy codec stores as it is).
LAYOUTS = {
    "fp32": (KVLayout(2, 2, 8, torch.float32), 16),
    "bf16": (KVLayout(4, 2, 64, torch.bfloat16), 32),
    "bf16-sliding": (
        KVLayout(
            4,
            2,
            8,
            torch.bfloat16,
            groups=(
                KVGroup(GroupKind.SLIDING, (0, 2), 128, keep=144),
                KVGroup(GroupKind.FULL, (1, 3)),
            ),
        ),
        256,
    ),
    "bf16-state": (
        KVLayout(
            4,
            2,
            8,
            torch.bfloat16,
            groups=(KVGroup(GroupKind.FULL, (0, 1, 2)), KVGroup(GroupKind.STATE, (3,), detail="t")),
        ),
        16,
    ),
}
# A lossy codec's decoded attention KV, relative L2 error against the page it encoded
# (fp8 measures about 2.6 %, int8 0.7 % on Gaussian KV).
LOSSY_REL_ERROR = 0.05
SENTINEL = 0xA5
CODEC_ID_FIELD = 88  # u16 (the byte table in kvtier/storage/records.py)
STORED_LEN_FIELD = 90  # u64
HEADER_HASHED = 114  # the header checksum covers bytes 0..114 and sits there


def kv_payload(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """Random KV values of the layout's dtype, as the flat bytes of a record payload."""
    gen = torch.Generator().manual_seed(seed)
    count = layout.payload_bytes(num_tokens) // layout.dtype_bytes
    values = torch.randn(count, generator=gen).to(layout.dtype)
    return values.view(torch.uint8)


def page_for(layout: KVLayout, chunk: int) -> torch.Tensor:
    return torch.full((layout.chunk_bytes(chunk),), SENTINEL, dtype=torch.uint8)


def rewrite_codec_id(record: bytes, codec_id: int) -> bytearray:
    """The record as a writer with codec ``codec_id`` would have labelled it: the id field
    changed and the header checksum made right again (so only the id is unknown)."""
    edited = bytearray(record)
    struct.pack_into("<H", edited, CODEC_ID_FIELD, codec_id)
    struct.pack_into("<Q", edited, HEADER_HASHED, xxhash.xxh3_64_intdigest(edited[:HEADER_HASHED]))
    return edited


def free_codec_id() -> int:
    taken = {c.codec_id for c in codecs.registered()}
    return next(i for i in range(0xFFFF, 0, -1) if i not in taken)


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class CodecContract:
    @pytest.fixture
    def codec(self) -> Iterator[PayloadCodec]:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture(params=list(LAYOUTS))
    def shape(self, request: pytest.FixtureRequest) -> tuple[KVLayout, int]:
        return LAYOUTS[request.param]

    @staticmethod
    def _record(
        codec: PayloadCodec, layout: KVLayout, chunk: int, num_tokens: int, seed: int = 1
    ) -> tuple[Fingerprint, bytes, bytes, torch.Tensor]:
        # The fingerprint a tier writing with the codec runs under (a lossy codec's names it).
        fp = tier_fingerprint(Fingerprint("codec-contract", layout, chunk), codec)
        key = os.urandom(16)
        data = kv_payload(layout, num_tokens, seed)
        return fp, key, records.encode_record(key, fp, num_tokens, data, codec), data

    def _assert_round_trip(
        self,
        codec: PayloadCodec,
        original: torch.Tensor,
        page: torch.Tensor,
        layout: KVLayout,
        num_tokens: int,
    ) -> None:
        n = original.numel()
        if codec.lossless:
            assert torch.equal(page[:n], original)
        else:
            assert_close_kv(layout, num_tokens, original, page[:n])
        assert bool((page[n:] == SENTINEL).all())  # nothing past the payload is written

    @pytest.mark.parametrize("part", ["full", "partial", "one token"])
    def test_a_payload_round_trips_through_a_record(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int], part: str
    ) -> None:
        layout, chunk = shape
        tokens = {"full": chunk, "partial": chunk // 2 + 1, "one token": 1}[part]
        fp, key, record, data = self._record(codec, layout, chunk, tokens)
        page = page_for(layout, chunk)
        assert record_reads.decode_record_into(record, fp, key, page) == tokens
        self._assert_round_trip(codec, data, page, layout, tokens)

    def test_stored_bytes_decode_directly_to_the_payload(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        data = kv_payload(layout, chunk, 2)
        before = data.clone()
        stored = memoryview(codec.encode(memoryview(data.numpy()), layout)).cast("B")
        assert torch.equal(data, before)  # encode only reads the page
        out = bytearray(data.numel())
        assert codec.decode(stored, memoryview(out), layout) == data.numel()
        if codec.lossless:
            assert bytes(out) == data.numpy().tobytes()
        else:
            assert_close_kv(layout, chunk, data, torch.frombuffer(out, dtype=torch.uint8))

    def test_the_header_names_the_codec_and_the_stored_length(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        fp, key, record, data = self._record(codec, layout, chunk, chunk)
        stored_len = len(record) - records.HEADER_SIZE
        assert struct.unpack_from("<H", record, CODEC_ID_FIELD) == (codec.codec_id,)
        assert struct.unpack_from("<Q", record, STORED_LEN_FIELD) == (stored_len,)
        header = records.decode_header(record, fp, key)
        assert header.codec is codec
        assert (header.stored_len, header.payload_len) == (stored_len, data.numel())
        assert header.record_len == len(record)
        assert header.stored_checksum == records.payload_checksum(record[records.HEADER_SIZE :])
        if codec.is_identity:
            assert stored_len == data.numel()

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_a_corrupt_stored_byte_is_a_miss_never_data(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int], where: str
    ) -> None:
        layout, chunk = shape
        fp, key, record, _ = self._record(codec, layout, chunk, chunk)
        stored_len = len(record) - records.HEADER_SIZE
        at = (
            records.HEADER_SIZE
            + {"first": 0, "middle": stored_len // 2, "last": stored_len - 1}[where]
        )
        bad = bytearray(record)
        bad[at] ^= 0x10
        page = page_for(layout, chunk)
        with pytest.raises(CorruptRecord, match="checksum"):
            record_reads.decode_record_into(bad, fp, key, page)
        assert bool((page == SENTINEL).all())  # nothing decoded, nothing written
        # The streamed path (the tiers'): land the stored bytes, hash them, finish.
        header = records.decode_header(bad, fp, key)
        target = record_reads.stored_target(header, page)
        target[:] = memoryview(bad)[records.HEADER_SIZE :]
        with pytest.raises(CorruptRecord, match="checksum"):
            record_reads.finish_read(header, records.payload_checksum(target), target, page, layout)

    def test_a_reader_that_does_not_know_the_codec_id_misses(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        fp, key, record, _ = self._record(codec, layout, chunk, chunk)
        unknown = free_codec_id()
        page = page_for(layout, chunk)
        with pytest.raises(UnknownRecordFormat, match=f"codec id {unknown} is not registered"):
            record_reads.decode_record_into(rewrite_codec_id(record, unknown), fp, key, page)
        assert bool((page == SENTINEL).all())
        if codec.is_identity:
            return  # identity is part of the format: every reader knows it
        codecs.unregister(codec.codec_id)  # a reader without this codec
        try:
            with pytest.raises(UnknownRecordFormat, match=f"codec id {codec.codec_id}"):
                records.decode_header(record, fp, key)
        finally:
            codecs.register(codec)
        assert record_reads.decode_record_into(record, fp, key, page) == chunk

    def test_a_cut_stored_stream_never_decodes_to_the_whole_payload(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        data = kv_payload(layout, chunk, 3)
        stored = bytes(memoryview(codec.encode(memoryview(data.numpy()), layout)).cast("B"))
        out = bytearray(data.numel())
        try:
            written = codec.decode(memoryview(stored[:-1]), memoryview(out), layout)
        except CorruptRecord:
            return  # refused: the reader misses
        assert written != data.numel()  # ... or short: records' length check refuses it

    def test_only_identity_reads_its_stored_bytes_into_the_page(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        fp, key, record, data = self._record(codec, layout, chunk, chunk)
        header = records.decode_header(record, fp, key)
        page = page_for(layout, chunk)
        target = record_reads.stored_target(header, page)
        assert target.nbytes == header.stored_len
        lands_in_page = page.data_ptr() <= address(target) < page.data_ptr() + page.numel()
        assert lands_in_page == codec.is_identity
        target[:] = memoryview(record)[records.HEADER_SIZE :]
        record_reads.finish_read(header, records.payload_checksum(target), target, page, layout)
        self._assert_round_trip(codec, data, page, layout, chunk)

    def test_a_record_of_another_fingerprint_is_refused_before_its_codec(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        fp, key, record, _ = self._record(codec, layout, chunk, chunk)
        other = dataclasses.replace(fp, model_name="another-model")
        with pytest.raises(CorruptRecord, match="fingerprint"):
            records.decode_header(record, other, key)

    def test_a_lossy_codec_is_another_cache_a_lossless_one_is_not(
        self, codec: PayloadCodec, shape: tuple[KVLayout, int]
    ) -> None:
        layout, chunk = shape
        fp = Fingerprint("codec-contract", layout, chunk)
        own = tier_fingerprint(fp, codec)
        if codec.lossless:
            assert own is fp  # any reader decodes it: keys and namespaces stay
            return
        assert own.lossy_codec == codec.name and own.digest() != fp.digest()
        key = os.urandom(16)
        record = records.encode_record(key, own, chunk, kv_payload(layout, chunk, 4), codec)
        with pytest.raises(CorruptRecord, match="fingerprint"):
            records.decode_header(record, fp, key)  # a reader without the codec configured


def assert_close_kv(
    layout: KVLayout, num_tokens: int, original: torch.Tensor, decoded: torch.Tensor
) -> None:
    """A lossy codec's page: the layout's dtype, every state layer byte for byte, the
    attention KV within LOSSY_REL_ERROR."""
    want = torch.zeros(layout.kv_shape(num_tokens), dtype=layout.dtype)
    got = torch.zeros_like(want)
    layout.unpack(original, want)
    layout.unpack(decoded, got)
    state = [i for g in layout.groups if g.kind == GroupKind.STATE for i in g.layers]
    attention = [i for i in range(layout.num_layers) if i not in state]
    assert torch.equal(got[:, state].view(torch.uint8), want[:, state].view(torch.uint8))
    a, b = got[:, attention].float(), want[:, attention].float()
    assert bool(a.isfinite().all())
    assert float((a - b).norm() / b.norm()) < LOSSY_REL_ERROR
