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
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError, CorruptRecord
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lease import LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import OnDone, PutOutcome, PutResult, TierUsage
from kvtier.storage.codecs import PayloadCodec, QuantizedCodec, tier_fingerprint
from kvtier.storage.cpu import CpuTier
from kvtier.storage.policy import EvictionPolicy
from kvtier.storage.records import payload_checksum

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


class CodedCpuTier(CpuTier):
    """The CPU tier storing each chunk through ``codec`` into ``store`` (module docstring)."""

    resident = False  # a hit is decoded into a staging page at load (PlanLoader)

    def __init__(
        self,
        pool: BlockPool,
        store: BlockPool,
        layout: KVLayout,
        codec: PayloadCodec,
        fingerprint: Fingerprint,
        policy: EvictionPolicy | None = None,
    ) -> None:
        super().__init__(pool, layout.payload_bytes, policy)
        self.store = store
        self.layout = layout
        self.codec = codec
        self.fingerprint = tier_fingerprint(fingerprint, codec)
        self._coded: dict[ChunkKey, CodedEntry] = {}
        self._fixed = isinstance(codec, QuantizedCodec)  # one slot a chunk

    # -- pages: staging only ---------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """``count`` staging pages (no entry lives in one, so none is evicted for them)."""
        return self.pool.allocate(count)

    def insert(self, key: ChunkKey, page: int, num_tokens: int, tenant: str | None = None) -> bool:
        """Encode ``page`` into the store under ``key``; the caller's page reference is taken
        over and given back at once (True), or left with the caller (False: already cached,
        declined by the policy, or no room even after eviction)."""
        with self._lock:
            if key in self._coded:
                self.policy.touch([key])
                return False
            if not self.policy.admit(key, num_tokens):
                self.counters.dropped += 1
                return False
        nbytes = self._payload(num_tokens)
        source = self.pool.page_bytes_view(page, nbytes).numpy().data
        stored = memoryview(self.codec.encode(source, self.layout)).cast("B")
        checksum = payload_checksum(stored)
        count = -(-stored.nbytes // self.store.page_bytes)
        with self._lock:
            if key in self._coded:  # another store of the same chunk got here first
                return False
            slots = self._slots_for(count)
            if slots is None:
                self.counters.dropped += 1
                return False
            self._write(slots, stored)
            self._coded[key] = CodedEntry(slots, stored.nbytes, checksum, num_tokens, nbytes)
            self.policy.insert(key)
            self.counters.stored += 1
            self.counters.bytes_written += stored.nbytes
            self.report_added((key,))
        self.pool.release([page])
        return True

    def _slots_for(self, count: int) -> list[int] | None:
        if count > self.store.num_pages:
            return None
        slots = self.store.allocate(count)
        while slots is None:
            if not self._evict(count - self.store.free_pages):
                return None
            slots = self.store.allocate(count)
        return slots

    def _write(self, slots: list[int], stored: memoryview) -> None:
        src = torch.frombuffer(stored, dtype=torch.uint8) if stored.nbytes else None
        at = 0
        for slot, n in self._pieces(slots, stored.nbytes):
            assert src is not None
            self.store.page_bytes_view(slot, n).copy_(src[at : at + n])
            at += n

    def _pieces(self, slots: list[int], nbytes: int) -> list[tuple[int, int]]:
        size = self.store.page_bytes
        return [(s, min(size, nbytes - i * size)) for i, s in enumerate(slots)]

    def _evict(self, needed: int) -> int:
        """Drop entries nobody holds (the policy's victims) until ``needed`` slots are freed;
        how many were freed."""
        if needed <= 0:
            return 0
        freed, victims = 0, []
        coded, is_shared = self._coded, self.store.is_shared
        while freed < needed:
            got = self.policy.evict(1, lambda key: not is_shared(coded[key].slots[0]))
            if not got:
                break
            entry = coded.pop(got[0])
            self.store.release(entry.slots)
            freed += len(entry.slots)
            victims += got
        self.counters.evicted += len(victims)
        self.report_evicted(victims)
        return freed

    def audit_slots(self, *, quiet: bool = True) -> list[str]:
        """Every slot reference has an owner (an entry, one per slot; a pin, one on the first
        slot), as sentences. ``quiet``: no read is in flight, so a reference nobody owns is
        a leak (a read holds its entry's slots for the time of the decode)."""
        with self._lock:
            refs, free = self.store.snapshot()
            owners = [0] * len(refs)
            for entry in self._coded.values():
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

    def owned_pages(self) -> set[int]:
        return set()  # entries hold slots of the store, never a pool page

    def entries(self, keys: Sequence[ChunkKey]) -> list[CodedEntry | None]:  # type: ignore[override]
        with self._lock:
            return [self._coded.get(k) for k in keys]

    def pin_prefix(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Never resident: the manager pins by key (``pin_many``) and loads through pages."""
        return []

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, object]:  # type: ignore[override]
        return {}

    # -- the common tier interface -----------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._coded for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        """Check the stored bytes' checksum, then decode them into ``out`` (a page view). A
        mismatch or a stream the codec refuses is a miss, and the entry is dropped."""
        with self._lock:
            entry = self._coded.get(key)
            if entry is None:
                self.counters.misses += 1
                return None
            self.store.retain(entry.slots)
        try:
            stored = self._stored(entry)
            target = out[: entry.nbytes]
            if payload_checksum(stored) != entry.checksum:
                raise CorruptRecord("stored bytes fail their checksum")
            if self.codec.decode(stored, target.numpy().data, self.layout) != entry.nbytes:
                raise CorruptRecord("decoded a short payload")
        except CorruptRecord as exc:
            self._drop_corrupt(key, entry, str(exc))
            return None
        finally:
            self.store.release(entry.slots)
        self.counters.hits += 1
        self.counters.bytes_read += entry.stored
        return entry.num_tokens

    def _stored(self, entry: CodedEntry) -> memoryview:
        """The entry's stored bytes: a view of its slots when they are contiguous (always, for
        a fixed-size codec), else gathered into a new buffer."""
        first, n = entry.slots[0], len(entry.slots)
        if entry.slots == list(range(first, first + n)):
            start = first * self.store.page_bytes
            return self.store.buffer[start : start + entry.stored].numpy().data
        gathered = torch.empty(entry.stored, dtype=torch.uint8)
        at = 0
        for slot, size in self._pieces(entry.slots, entry.stored):
            gathered[at : at + size].copy_(self.store.page_bytes_view(slot, size))
            at += size
        return gathered.numpy().data

    def _drop_corrupt(self, key: ChunkKey, entry: CodedEntry, reason: str) -> None:
        log.warning("cpu tier: chunk %s is corrupt (%s): dropped, a miss", key.hex(), reason)
        self.note_corrupt(key, reason)
        with self._lock:
            self.counters.corrupt += 1
            self.counters.misses += 1
            if self._coded.get(key) is entry:
                del self._coded[key]
                self.policy.remove(key)
                self.store.release(entry.slots)
                self.report_removed((key,))

    def put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        if self.contains([key])[0]:
            on_done(PutResult(key, PutOutcome.EXISTS))
            return
        pages = self.pool.allocate(1)
        if pages is None:
            self.counters.dropped += 1
            on_done(PutResult(key, PutOutcome.DROPPED, "no free staging page"))
            return
        self.pool.page_bytes_view(pages[0], payload.numel()).copy_(payload)
        if not self.insert(key, pages[0], num_tokens):
            self.pool.release(pages)
            stored = self.contains([key])[0]
            on_done(PutResult(key, PutOutcome.EXISTS if stored else PutOutcome.DROPPED))
            return
        on_done(PutResult(key, PutOutcome.STORED))

    def pin(self, key: ChunkKey) -> bool:
        return self.pin_many([key]) == 1

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        """Pin the leading run of ``keys`` that is cached and mark it used (the policy's
        touch, as a CPU lookup does), under one lock; how many were pinned. A pin is one
        reference to the entry's first slot, what eviction looks at: a reader retains every
        slot for itself (get_into), so nothing more is needed to keep the bytes."""
        with self._lock:
            pinned = 0
            for key in keys:
                entry = self._coded.get(key)
                if entry is None:
                    break
                self.store.retain(entry.slots[:1])
                self._key_pins.record(key, entry.slots[0])
                pinned += 1
            if pinned:
                self.policy.touch(keys[:pinned])
        return pinned

    def make_room(self, chunks: int) -> None:
        """Evict now what ``chunks`` whole chunks need, as the identity tier's page
        allocation does before a store's inserts (so a store's own chunks do not push each
        other out): a lossless chunk is counted at the store's mean slots per entry."""
        with self._lock:
            per_chunk = (
                self.store.used_pages / len(self._coded) if self._coded and not self._fixed else 1
            )
            self._evict(math.ceil(chunks * per_chunk) - self.store.free_pages)

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            slot = self._key_pins.take(key)
        if slot is not None:  # None: nothing pinned under this key, never a second release
            self.store.release([slot])

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._coded.pop(key, None)
            if entry is None:
                return False
            self.policy.remove(key)
            self.store.release(entry.slots)
            self.report_removed((key,))
            return True

    def usage(self) -> TierUsage:
        with self._lock:
            used = sum(len(e.slots) for e in self._coded.values())
            entries = len(self._coded)
        size = self.store.page_bytes
        return TierUsage(used * size, self.store.num_pages * size, entries)

    def clear(self, *, force: bool = False) -> int:
        """Drop unpinned entries (all with ``force``; a pinned entry's slots stay alive until
        its pins end, as they hold their own references)."""
        with self._lock:
            shared = self.store.is_shared
            victims = [k for k, e in self._coded.items() if force or not shared(e.slots[0])]
            for key in victims:
                self.store.release(self._coded.pop(key).slots)
                if not force:
                    self.policy.remove(key)
            if force:
                self.policy.clear()
            self.report_removed(victims)
        return len(victims)

    def close(self) -> None:
        super().close()
        self.store.close()

    def __len__(self) -> int:
        return len(self._coded)
