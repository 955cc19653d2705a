"""The self-describing, checksummed record of one chunk, shared by the disk and redis tiers.

A record is a fixed-size header followed by the chunk's stored bytes: its payload (the first
``layout.payload_bytes(num_tokens)`` bytes of its page: every KV-cache group's part of the
chunk, so a chunk is all its groups or none, under one checksum) as the record's payload
codec (:mod:`kvtier.storage.codecs`) encoded it. With the identity codec (id 0) the stored
bytes are the payload itself::

    offset  size  field
    0       8     magic  b"KVTIERC\\n"
    8       2     format version (RECORD_VERSION = 2)
    10      2     header size (HEADER_SIZE, so a reader can refuse a different layout early)
    12      16    chunk key (the full 16-byte chained digest)
    28      16    fingerprint digest (model, layout, chunk size, hash, TP rank, salt)
    44      4     num_layers
    48      4     num_kv_heads
    52      4     head_dim
    56      16    dtype name, ASCII, NUL padded ("bfloat16")
    72      4     chunk_size (tokens)
    76      4     num_tokens in this chunk (1 .. chunk_size)
    80      8     payload length in bytes, decoded (= layout.payload_bytes(num_tokens))
    88      2     payload codec id (0 = identity; kvtier.storage.codecs)
    90      8     stored length s in bytes (= the payload length for identity)
    98      16    stored checksum: xxh3-128 of the s stored bytes
    114     8     header checksum: xxh3-64 of bytes 0..114 (covers the stored checksum too)
    122     2     part count p: 0, or the KV-cache groups of a page made of group parts
                  (a layout with a trimmed sliding group, see kvtier.layout; identity only)
    124     8*p   xxh3-64 of each part of the payload, in page order
    124+8p  8     xxh3-64 of bytes 122..124+8p
    ..      ..    zero padding up to HEADER_SIZE
    4096    s     stored bytes (the payload, encoded by the codec)

The part checksums only name what failed: stored bytes that fail their checksum are a miss,
and the part whose own checksum differs names the KV-cache group (``explain`` shows it). A
chunk is every group or none: one record, one stored checksum. Only identity records carry
part checksums: the bytes of another codec have no page offsets to cut parts at.

Why two checksums: the header checksum lets the disk tier rebuild its index at start by
reading headers only (a torn or edited header is caught without touching the payload); the
stored checksum, which the header checksum covers, is checked on every read, over the
*stored* bytes, so a corrupt byte is caught before a codec decodes it, and the decoded length
is then checked against the payload length. Together they cover every header field and every
stored byte.

Why 4096 bytes of header: the stored bytes then start at a page-aligned file offset, so an
identity record can be read with O_DIRECT straight into a page-aligned allocator page.

Zero copy for identity: a writer hands the page itself to the file or the socket
(:func:`encode_parts` returns a view of it), and a reader reads the stored bytes straight
into the page (:mod:`kvtier.storage.record_reads`: ``stored_target`` is the page for
identity, a scratch buffer for another codec, which ``finish_read`` then decodes into it).

The codec id is bound to the fingerprint: a lossy codec's records live under a fingerprint
that names it (``Fingerprint.lossy_codec``, :func:`~kvtier.storage.codecs.tier_fingerprint`),
exact ones (identity, lossless) under one that names none. A record whose codec is not its
fingerprint's (an fp8 record under an exact reader's fingerprint, an int8 one under an fp8
reader's) is no record an honest writer makes, so it is a :class:`~kvtier.errors.CorruptRecord`:
a miss, logged and dropped like any corrupt one, never lossy bytes served to a reader of
another codec. :func:`encode_parts` refuses to write one.

Records of another format version (the files of a kvtier before this format, after an
upgrade) and records of a codec id not registered in this process raise
:class:`~kvtier.errors.UnknownRecordFormat`, a :class:`~kvtier.errors.CorruptRecord`: a miss.
The disk tier drops such a file like any corrupt one (the startup scan removes it, a read
removes it) and logs the kind once per 30 s rather than per chunk; the redis tier misses
without deleting it (another engine of the fleet may read it; this engine's next store of the
chunk replaces it). There is no conversion: version 1 records are dropped, the cache refills.

Checksums are computed over the payload tensor's memory (a memoryview of its numpy view),
never over a ``bytes`` copy. xxh3-128 runs at about 25 GiB/s on these machines.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvtier.errors import CorruptRecord, UnknownRecordFormat
from kvtier.fingerprint import KEY_BYTES, Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout, dtype_name
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_by_id

RECORD_MAGIC = b"KVTIERC\n"
RECORD_VERSION = 2
HEADER_SIZE = 4096

# Everything before the header checksum, then the header checksum itself.
_FIELDS = struct.Struct("<8sHH16s16sIII16sIIQHQ16s")
_HEADER_HASH = struct.Struct("<Q")
_HASHED_BYTES = _FIELDS.size  # 114
_PARTS_AT = _HASHED_BYTES + _HEADER_HASH.size  # 122
_COUNT = struct.Struct("<H")
_HASH64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded header; ``stored_checksum`` is what a read checks
    (:func:`kvtier.storage.record_reads.verify_stored`),
    ``codec`` the registered codec its id names."""

    key: ChunkKey
    num_tokens: int
    payload_len: int  # decoded: layout.payload_bytes(num_tokens)
    stored_len: int  # the bytes after the header
    stored_checksum: bytes
    codec: PayloadCodec = IDENTITY
    part_checksums: tuple[int, ...] = ()  # per KV-cache group part, when the page has parts

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.stored_len


def header_size() -> int:
    """Bytes before the stored bytes (fixed, page-aligned)."""
    return HEADER_SIZE


def payload_view(payload: torch.Tensor | memoryview | bytes) -> memoryview:
    """The payload's bytes without copying them."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise ValueError(
                f"payload must be a flat contiguous uint8 tensor, got {payload.dtype} "
                f"shape {tuple(payload.shape)}"
            )
        return memoryview(payload.numpy())  # type: ignore[arg-type]
    return memoryview(payload).cast("B")


def payload_checksum(payload: torch.Tensor | memoryview | bytes) -> bytes:
    """xxh3-128 of the bytes (16 bytes): a record's stored checksum is this of its stored
    bytes."""
    return bytes(xxhash.xxh3_128_digest(payload_view(payload)))


@functools.lru_cache(maxsize=64)
def _fingerprint_digest(fingerprint: Fingerprint) -> bytes:
    # Every record's header names its fingerprint: a tier has one, so its digest (the
    # canonical string hashed, ~65 us) is computed once, not once per record read or written.
    return fingerprint.digest()[:KEY_BYTES].ljust(KEY_BYTES, b"\0")


def encode_parts(
    key: ChunkKey,
    fingerprint: Fingerprint,
    num_tokens: int,
    payload: torch.Tensor | memoryview | bytes,
    codec: PayloadCodec = IDENTITY,
) -> tuple[bytes, memoryview]:
    """The HEADER_SIZE-byte header and the stored bytes of a record of ``payload`` (flat
    uint8, ``num_tokens`` tokens' bytes), encoded by ``codec``. For identity the stored
    bytes are a view of ``payload`` itself: write both buffers, nothing is joined."""
    lay = fingerprint.layout
    view = payload_view(payload)
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    if not 0 < num_tokens <= fingerprint.chunk_size:
        raise ValueError(f"num_tokens must be in 1..{fingerprint.chunk_size}, got {num_tokens}")
    if view.nbytes != lay.payload_bytes(num_tokens):
        raise ValueError(
            f"payload is {view.nbytes} bytes, but {num_tokens} tokens take "
            f"{lay.payload_bytes(num_tokens)}"
        )
    if codec_by_id(codec.codec_id) is not codec:
        raise ValueError(f"{codec!r} is not registered: nothing could read its records")
    if _bound_codec(codec) != fingerprint.lossy_codec:
        raise ValueError(_codec_mismatch(codec, fingerprint) + ": use tier_fingerprint()")
    stored = memoryview(codec.encode(view, lay)).cast("B")
    fields = _FIELDS.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        HEADER_SIZE,
        key,
        _fingerprint_digest(fingerprint),
        lay.num_layers,
        lay.num_kv_heads,
        lay.head_dim,
        dtype_name(lay.dtype).encode("ascii"),
        fingerprint.chunk_size,
        num_tokens,
        view.nbytes,
        codec.codec_id,
        stored.nbytes,
        payload_checksum(stored),
    )
    head = fields + _HEADER_HASH.pack(xxhash.xxh3_64_intdigest(fields))
    parts = _encode_parts(lay, num_tokens, view) if codec.is_identity else b""
    return head + parts + bytes(HEADER_SIZE - len(head) - len(parts)), stored


def encode_header(
    key: ChunkKey,
    fingerprint: Fingerprint,
    num_tokens: int,
    payload: torch.Tensor | memoryview | bytes,
) -> bytes:
    """The header of an identity record of ``payload`` (the caller writes the payload after
    it, as is)."""
    return encode_parts(key, fingerprint, num_tokens, payload)[0]


def _encode_parts(lay: KVLayout, num_tokens: int, view: memoryview) -> bytes:
    """The part-checksum block of a page made of group parts (empty otherwise)."""
    if not lay.trims:
        return b""
    parts = lay.page_parts(num_tokens)
    block = _COUNT.pack(len(parts)) + b"".join(
        _HASH64.pack(xxhash.xxh3_64_intdigest(view[at : at + n])) for _, at, n in parts
    )
    return block + _HASH64.pack(xxhash.xxh3_64_intdigest(block))


def _decode_parts(view: memoryview) -> tuple[int, ...]:
    """Part checksums of a header, or () when it has none (or their block is damaged: they
    only name a failure, the stored checksum decides it)."""
    (count,) = _COUNT.unpack_from(view, _PARTS_AT)
    end = _PARTS_AT + _COUNT.size + 8 * count
    if count == 0 or end + 8 > min(view.nbytes, HEADER_SIZE):
        return ()
    (stored,) = _HASH64.unpack_from(view, end)
    if stored != xxhash.xxh3_64_intdigest(view[_PARTS_AT:end]):
        return ()
    return tuple(_HASH64.unpack_from(view, _PARTS_AT + 2 + 8 * i)[0] for i in range(count))


def decode_header(
    buf: bytes | bytearray | memoryview,
    fingerprint: Fingerprint,
    expected_key: ChunkKey | None = None,
) -> RecordHeader:
    """Parse and check a header (the first HEADER_SIZE bytes of ``buf``; more is ignored).

    Raises :class:`CorruptRecord` naming the first problem: short buffer, magic, version,
    header checksum, fingerprint, layout, chunk size, key, token count, payload length,
    codec (or a codec its fingerprint does not name) or stored length. Another format version
    or a codec id not registered here raise its subclass :class:`UnknownRecordFormat` (module
    docstring).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes >= _COUNT.size + len(RECORD_MAGIC):
        (magic,) = struct.unpack_from("<8s", view)
        (version,) = _COUNT.unpack_from(view, len(RECORD_MAGIC))
        if magic == RECORD_MAGIC and version != RECORD_VERSION:
            raise UnknownRecordFormat(
                f"record format version {version}, this kvtier reads {RECORD_VERSION}"
            )
    if view.nbytes < _PARTS_AT:
        raise CorruptRecord(f"record header truncated: {view.nbytes} bytes")
    fields = _FIELDS.unpack_from(view)
    magic, _, hsize, key, fp, layers, heads, head_dim, dtype, chunk, tokens, plen = fields[:12]
    codec_id, slen, csum = fields[12:]
    if magic != RECORD_MAGIC:
        raise CorruptRecord(f"bad record magic {bytes(magic)!r}")
    if hsize != HEADER_SIZE:
        raise CorruptRecord(f"record header size {hsize}, expected {HEADER_SIZE}")
    (stored_hash,) = _HEADER_HASH.unpack_from(view, _HASHED_BYTES)
    if stored_hash != xxhash.xxh3_64_intdigest(view[:_HASHED_BYTES]):
        raise CorruptRecord("record header checksum mismatch")
    if fp != _fingerprint_digest(fingerprint):
        raise CorruptRecord("record belongs to another fingerprint (model, layout or tenant)")
    lay = fingerprint.layout
    layout_seen = (layers, heads, head_dim, dtype.rstrip(b"\0").decode("ascii", "replace"))
    layout_want = (lay.num_layers, lay.num_kv_heads, lay.head_dim, dtype_name(lay.dtype))
    if layout_seen != layout_want:
        raise CorruptRecord(f"record layout {layout_seen} does not match {layout_want}")
    if chunk != fingerprint.chunk_size:
        raise CorruptRecord(f"record chunk size {chunk}, expected {fingerprint.chunk_size}")
    if expected_key is not None and key != expected_key:
        raise CorruptRecord(f"record holds key {bytes(key).hex()}, expected {expected_key.hex()}")
    if not 0 < tokens <= chunk:
        raise CorruptRecord(f"record token count {tokens} outside 1..{chunk}")
    if plen != lay.payload_bytes(tokens):
        raise CorruptRecord(f"record payload length {plen} != {tokens} tokens' bytes")
    codec = codec_by_id(codec_id)
    if codec is None:
        raise UnknownRecordFormat(
            f"record payload codec id {codec_id} is not registered in this kvtier"
        )
    if _bound_codec(codec) != fingerprint.lossy_codec:
        raise CorruptRecord(_codec_mismatch(codec, fingerprint))
    if codec.is_identity and slen != plen:
        raise CorruptRecord(f"identity record stores {slen} bytes of a {plen}-byte payload")
    return RecordHeader(bytes(key), tokens, plen, slen, bytes(csum), codec, _decode_parts(view))


def _bound_codec(codec: PayloadCodec) -> str:
    """What a fingerprint says of the records of ``codec``: its name for a lossy codec, ""
    for identity and lossless (any reader decodes those to the model's own bytes)."""
    return "" if codec.lossless else codec.name


def _codec_mismatch(codec: PayloadCodec, fingerprint: Fingerprint) -> str:
    want = fingerprint.lossy_codec or "an exact one (identity or lossless)"
    return f"record payload codec {codec.name!r} is not its fingerprint's codec ({want})"


def encode_record(
    key: ChunkKey,
    fingerprint: Fingerprint,
    num_tokens: int,
    payload: torch.Tensor | memoryview | bytes,
    codec: PayloadCodec = IDENTITY,
) -> bytes:
    """Header and stored bytes as one ``bytes`` (for a value held in memory, e.g. a redis
    SET)."""
    header, stored = encode_parts(key, fingerprint, num_tokens, payload, codec)
    return header + stored.tobytes()
