"""The CPU tier through a payload codec (``cpu_codec``): more chunks in the same RAM.

With the identity codec (the default) the CPU tier is :class:`~kvtier.storage.cpu.CpuTier`:
an entry *is* a page of the block pool, and a hit is served from it with no copy. With any
other codec an entry is the codec's stored bytes, and the RAM is split in two
(:func:`split_capacity`)::

    max_local_cpu_size  =  staging pages (the block pool)    +   the coded store (slots)
                           cpu_codec_staging (auto: 1/16)         the rest

    store   kv -> a staging page (the engine's one copy) -> encode -> the entry's slots,
            xxh3-128 of the stored bytes; the page goes back to the pool once the lower-tier
            writes that share it have landed (the entry never holds a page)
    lookup  the entry pinned by key, as a disk hit is: the storage manager treats a CPU
            tier that is not ``resident`` as it treats a lower tier
    load    the stored bytes' checksum checked, then decoded into a staging page held by
            the request's lease; copied into the caller's tensor, that page is reused for
            the next chunk (``PlanLoader.load``), so a hit is not bounded by the pages

So staging pages bound what is in flight (the chunks of stores being encoded, of lower-tier
writes not yet landed, of hits a reader of pages holds), and the coded store bounds what is
cached. A page count per chunk does not change: a decoded chunk is one page, as
everywhere else in kvtier.

Slots. The store is a second :class:`~kvtier.memory.block_pool.BlockPool` (reference counts
stay in the one class that owns them). A fixed-size codec (fp8, int8: ``stored_bytes`` is
exact) has slots of one full chunk's stored bytes, so an entry is one slot, contiguous, and
decodes straight from it. A byte codec (lossless) has slots of 1/16 of a chunk and an entry
takes as many as its stored bytes need; when they are not contiguous the read gathers them
into a scratch buffer first (one copy of the stored bytes).

The invariants of the identity tier hold: an entry holds one reference to each of its slots,
a pin (by key: ``pin``/``pin_many``, which the manager holds in the request's lease) one
more to its first slot, a read one to each while it decodes, and eviction skips an entry
whose first slot anyone else holds; every read checks the checksum of the stored bytes
before decoding, and a mismatch is a miss (logged, counted, the entry dropped). A lossy
codec's tier reports :attr:`fingerprint` with the codec in it
(:func:`~kvtier.storage.codecs.tier_fingerprint`); its entries never leave this process
encoded (a lower tier is written from the staging page, at the engine's own precision), so
no reader with another codec can take them. A lossy codec that failed the quality gate for
the layout's dtype is refused before the tier is built (``tiers.cpu_pages``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError, CorruptRecord
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.lease import LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.codecs import PayloadCodec, QuantizedCodec, tier_fingerprint
from kvtier.storage.cpu import CpuTier
from kvtier.storage.policy import EvictionPolicy
from kvtier.storage.records import payload_checksum
from kvtier.storage.tenants.local import TenantPolicy

log = logging.getLogger(__name__)
# A byte codec's stored bytes are immutable ``bytes``: torch warns (once) that the tensor
# viewing them is read-only. Only read, to copy them into slots.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

STAGING_SHARE = 16  # cpu_codec_staging auto: 1/16 of max_local_cpu_size
BYTE_CODEC_SLOTS = 16  # slots per chunk for a codec whose stored size varies
_ALIGN = 64


def slot_shape(codec: PayloadCodec, layout: KVLayout, chunk_size: int) -> tuple[int, int]:
    """(bytes of one slot of the coded store, slots a whole chunk takes at most)."""
    if isinstance(codec, QuantizedCodec):  # stored_bytes is exact: one slot a chunk
        size, per_chunk = codec.stored_bytes(layout, chunk_size), 1
    else:
        size, per_chunk = -(-layout.chunk_bytes(chunk_size) // BYTE_CODEC_SLOTS), BYTE_CODEC_SLOTS
    return -(-size // _ALIGN) * _ALIGN, per_chunk


def split_capacity(
    capacity: int, staging: int, chunk_bytes: int, slot: tuple[int, int]
) -> tuple[int, int]:
    """(staging pages, store slots) of ``capacity`` bytes (``max_local_cpu_size``), with
    ``staging`` bytes of pages asked for (0: 1/16 of the capacity, at least one page) and
    ``slot`` from :func:`slot_shape`. Both are ceilings rounded down; the staging must hold
    a chunk and the store what one chunk takes, else ConfigError naming the key."""
    if 0 < staging < chunk_bytes:
        raise ConfigError("cpu_codec_staging", staging, f"at least one chunk ({chunk_bytes} bytes)")
    pages = max(1, (staging if staging > 0 else capacity // STAGING_SHARE) // chunk_bytes)
    slot_size, per_chunk = slot
    slots = max(0, capacity - pages * chunk_bytes) // slot_size
    if slots < per_chunk:
        key, value = ("cpu_codec_staging", staging) if staging else ("max_local_cpu_size", capacity)
        raise ConfigError(
            key,
            value,
            f"room within max_local_cpu_size ({capacity} bytes) for the staging pages "
            f"({pages} x {chunk_bytes} bytes) and one coded chunk ({per_chunk} x {slot_size})",
        )
    return pages, slots


@dataclass(slots=True, eq=False)
class CodedEntry:
    slots: list[int]  # the first one is what pins and eviction look at
    stored: int  # bytes of the codec's output
    checksum: bytes  # xxh3-128 of them
    num_tokens: int
    nbytes: int  # the decoded payload


class CodedEntries:
    """Entries as a codec's stored bytes in slots of ``store`` (the module docstring): the
    :class:`~kvtier.storage.cpu.Entries` of a CPU tier through a codec."""

    resident = False  # a hit is decoded into a staging page at load (PlanLoader)

    def __init__(
        self, pages: BlockPool, store: BlockPool, layout: KVLayout, codec: PayloadCodec
    ) -> None:
        """``pages``: the staging pool a stored page comes from; ``store``: the slots."""
        self.pages = pages
        self.holder = store
        self.layout = layout
        self.codec = codec

    def pin_ref(self, entry: CodedEntry) -> int:
        return entry.slots[0]

    def refs(self, entry: CodedEntry) -> list[int]:
        return entry.slots

    def num_tokens(self, entry: CodedEntry) -> int:
        return entry.num_tokens

    def stored_bytes(self, entry: CodedEntry) -> int:
        return entry.stored

    def prepare(self, page: int, num_tokens: int) -> tuple[memoryview, bytes, int]:
        """Encode the staging page (outside the tier's lock): its stored bytes, their
        checksum, and the payload's size."""
        nbytes = self.layout.payload_bytes(num_tokens)
        source = self.pages.page_bytes_view(page, nbytes).numpy().data
        stored = memoryview(self.codec.encode(source, self.layout)).cast("B")
        return stored, payload_checksum(stored), nbytes

    def admit(
        self,
        page: int,
        num_tokens: int,
        prepared: tuple[memoryview, bytes, int],
        room: Callable[[int], int],
    ) -> CodedEntry | None:
        stored, checksum, nbytes = prepared
        slots = self._slots_for(-(-stored.nbytes // self.holder.page_bytes), room)
        if slots is None:
            return None
        self._write(slots, stored)
        return CodedEntry(slots, stored.nbytes, checksum, num_tokens, nbytes)

    def settle(self, page: int) -> None:
        self.pages.release([page])  # the entry is its slots: the staging page goes back

    def read_into(self, entry: CodedEntry, out: torch.Tensor) -> None:
        """Check the stored bytes' checksum, then decode them into ``out``."""
        stored = self._stored(entry)
        target = out[: entry.nbytes]
        if payload_checksum(stored) != entry.checksum:
            raise CorruptRecord("stored bytes fail their checksum")
        if self.codec.decode(stored, target.numpy().data, self.layout) != entry.nbytes:
            raise CorruptRecord("decoded a short payload")

    def _slots_for(self, count: int, room: Callable[[int], int]) -> list[int] | None:
        store = self.holder
        if count > store.num_pages:
            return None
        slots = store.allocate(count)
        while slots is None:
            if not room(count - store.free_pages):
                return None
            slots = store.allocate(count)
        return slots

    def _write(self, slots: list[int], stored: memoryview) -> None:
        src = torch.frombuffer(stored, dtype=torch.uint8) if stored.nbytes else None
        at = 0
        for slot, n in self._pieces(slots, stored.nbytes):
            assert src is not None
            self.holder.page_bytes_view(slot, n).copy_(src[at : at + n])
            at += n

    def _pieces(self, slots: list[int], nbytes: int) -> list[tuple[int, int]]:
        size = self.holder.page_bytes
        return [(s, min(size, nbytes - i * size)) for i, s in enumerate(slots)]

    def _stored(self, entry: CodedEntry) -> memoryview:
        """The entry's stored bytes: a view of its slots when they are contiguous (always, for
        a fixed-size codec), else gathered into a new buffer."""
        first, n = entry.slots[0], len(entry.slots)
        if entry.slots == list(range(first, first + n)):
            start = first * self.holder.page_bytes
            return self.holder.buffer[start : start + entry.stored].numpy().data
        gathered = torch.empty(entry.stored, dtype=torch.uint8)
        at = 0
        for slot, size in self._pieces(entry.slots, entry.stored):
            gathered[at : at + size].copy_(self.holder.page_bytes_view(slot, size))
            at += size
        return gathered.numpy().data


class CodedCpuTier(CpuTier):
    """The CPU tier storing each chunk through ``codec`` into ``store``: a
    :class:`~kvtier.storage.cpu.CpuTier` whose entries are :class:`CodedEntries` (the index,
    policy, tenants, pins and eviction are the plain tier's)."""

    def __init__(
        self,
        pool: BlockPool,
        store: BlockPool,
        layout: KVLayout,
        codec: PayloadCodec,
        fingerprint: Fingerprint,
        policy: EvictionPolicy | None = None,
        *,
        tenants: TenantPolicy | None = None,
    ) -> None:
        entries = CodedEntries(pool, store, layout, codec)
        super().__init__(pool, layout.payload_bytes, policy, entries, tenants=tenants)
        self.store = store
        self.layout = layout
        self.codec = codec
        self.fingerprint = tier_fingerprint(fingerprint, codec)

    def audit_slots(self, *, quiet: bool = True) -> list[str]:
        """Every slot reference has an owner (an entry, one per slot; a pin, one on the first
        slot), as sentences. ``quiet``: no read is in flight, so a reference nobody owns is
        a leak (a read holds its entry's slots for the time of the decode)."""
        with self._lock:
            refs, free = self.store.snapshot()
            owners = [0] * len(refs)
            for entry in self._index.values():
                for slot in entry.slots:
                    owners[slot] += 1
            pinned = [self._key_pins.references_to(s) for s in range(len(refs))]
        problems = []
        for slot, (ref, own) in enumerate(zip(refs, owners, strict=True)):
            own += pinned[slot]
            if ref < own or (quiet and ref > own):
                problems.append(f"cpu store slot {slot}: refcount {ref}, {own} owners")
        if free != refs.count(0):
            problems.append("cpu store: free list does not match the slots with refcount 0")
        return problems

    def audit(self, leases: LeaseTable[Any]) -> list[str]:
        return self.audit_slots(quiet=not len(leases))

    def close(self) -> None:
        super().close()
        self.store.close()
