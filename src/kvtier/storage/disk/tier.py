"""The disk tier: one checksummed record file per chunk, crash-safe, rebuilt at every open.

This module is the tier's front (:class:`~kvtier.storage.base.Tier`): its lifecycle, pins,
removal and usage. The parts it composes work on one shared
:class:`~kvtier.storage.disk.state.DiskState`, under one lock::

    writes.py         put: admitted at once, then written by a writer thread (its protocol)
    reads.py          get_into / get_many_into: read into the caller's page, checked
    state.py          the index, counters and directory, and a directory deleted under us
    files.py          the record files         snapshot.py   the saved index
    reconcile.py      the check of a saved index against the directory
    budget.py         the directory's capacity, shared by its tiers
    bounded_reads.py  the reader pool, bounded   directory.py  the directory's descriptor
    counters.py       what the tier counts       options.py    its settings

Membership (``Tier.add_membership_listener``, what KV events publish): a chunk is added when
its write commits (never when queued), and removed when evicted, removed, cleared, found
corrupt or vanished on a read, named by the saved index but gone, or when the directory is
lost (all of them at once).

``on_done`` runs exactly once per put, before the put stops counting as in flight, so once
:meth:`flush` returns every callback has run (the storage manager's staging pages are back).
The payload page is read, never written, until then. Files evicted to make room are reported
to the eviction listeners (``Tier.add_evict_listener``) once they are unlinked.

Writes encode the payload with the tier's codec (``codec``, identity by default); reads
decode whatever registered codec a file names (:mod:`~kvtier.storage.disk.reads`).

A clean close saves the index (:mod:`~kvtier.storage.disk.snapshot`). An open with a usable
saved index builds the index from it alone and serves at once; a background check
(:mod:`~kvtier.storage.disk.reconcile`) then lists the directory, adds the files the saved
index does not name, drops the entries whose file is gone and removes
leftovers. The files stay the truth: every read checks its file, so a trusted entry whose
file is gone or corrupt is a miss. Without a saved index (or with a torn one) the open
rebuilds the index from the headers (oldest file first, by mtime, which writes and read hits
set), deletes temporary leftovers of this fingerprint, and removes and counts bad files
(:mod:`~kvtier.storage.disk.state`).

Faults (docs/disk.md): reads are bounded by ``blocking_timeout_secs``
(:mod:`~kvtier.storage.disk.bounded_reads`); a chunk name that is not a regular file (a
FIFO) is a corrupt miss (:mod:`~kvtier.storage.disk.files`); a deleted directory drops the
index and is re-opened when usable (:mod:`~kvtier.storage.disk.state`); :meth:`close`
waits for calls in flight, bounded, and never on a stuck reader.

Capacity is per directory, not per tier (:mod:`~kvtier.storage.disk.budget`): every disk
tier of this process open on one directory shares one budget and one lock (the tier's own
until :meth:`DiskTier.open`), and a write may evict another fingerprint's files. Files
evicted from another tier are reported to that tier's listeners.

Settings: :mod:`kvtier.storage.disk.options`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from kvtier.config import Config
from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError, StateError
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.storage.base import PutJob, PutOutcome, PutResult, Tier, TierUsage
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.disk import budget, files, snapshot
from kvtier.storage.disk.bounded_reads import BoundedReads
from kvtier.storage.disk.budget import Evicted
from kvtier.storage.disk.counters import DiskCounters
from kvtier.storage.disk.index import DiskIndex
from kvtier.storage.disk.options import DiskOptions, options_from_config
from kvtier.storage.disk.quotas import DiskQuotas
from kvtier.storage.disk.reads import DiskReads
from kvtier.storage.disk.reconcile import SavedIndexCheck
from kvtier.storage.disk.state import DiskState
from kvtier.storage.disk.writes import DiskWrites
from kvtier.storage.records import HEADER_SIZE
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.write_queue import complete

log = logging.getLogger(__name__)


class DiskTier(Tier):
    name = "disk"
    medium = "DISK"
    counters: DiskCounters

    def __init__(
        self,
        options: DiskOptions,
        layout: KVLayout,
        fingerprint: Fingerprint,
        codec: PayloadCodec = IDENTITY,
    ) -> None:
        super().__init__()
        self.options = options
        self.layout = layout
        # A lossy codec makes another cache: its own namespace and record headers.
        self.fingerprint = tier_fingerprint(fingerprint, codec)
        self.codec = codec  # what writes encode with; reads decode any registered codec
        self.fp_hex = self.fingerprint.hex()
        self._state = DiskState(self, options, self.fingerprint, codec)
        self.counters = self._state.counters
        self._opening = False
        self._guard = CallGuard("disk tier")
        self._writes = DiskWrites(self._state)
        self._reads = DiskReads(self._state)
        self._reader: BoundedReads | None = None
        self._quotas: DiskQuotas | None = None

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> DiskTier:
        """Validate the disk keys (nothing touches the disk until :meth:`open`)."""
        options = options_from_config(config, layout, fingerprint.chunk_size)
        codec = codec_from_config("disk_codec", config.disk_codec, layout.dtype)
        return cls(options, layout, fingerprint, codec)

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Check the directory, build the index (from the saved index, checked in the
        background, or from the headers), join the directory's budget and trim the directory
        to it, start the I/O threads. The files are read before the directory's lock is
        taken: another tier of the directory keeps serving meanwhile."""
        state = self._state
        with state.lock:
            if self._guard.state is not Lifecycle.NEW or self._opening:
                raise StateError(f"disk tier is {self._guard.state.value}; open it once")
            self._opening = True
        try:
            dir_fd = state.dir.open()
            try:
                shared = budget.of_directory(dir_fd, self.options.path)
                if self._quotas is not None:  # before the index: its files' tenants
                    self._quotas.load(dir_fd)
                rows = snapshot.load_rows(dir_fd, self.fingerprint)
                found = state.scan(dir_fd) if rows is None else None
                if rows is not None:
                    state.index.add_rows(rows)
                if self._quotas is not None:
                    self._quotas.loaded()
            except OSError as exc:
                state.dir.close()
                raise ConfigError(
                    "local_disk", self.options.path, f"a readable directory ({exc.strerror})"
                ) from None
        except BaseException:
            self._opening = False
            raise
        state.budget, state.lock = shared, shared.lock  # nothing else uses the tier yet
        with state.lock:
            shared.join(self)
            if found is not None:
                shared.add_released(found.others)
            trimmed = self.evict_to_fit()
            if found is not None:
                state.log_scan(found, trimmed)
            else:
                state.check = self._trust_saved_index(trimmed)
        trimmed.report()
        self._writes.queue.open()
        n = self.options.io_threads
        self._reader = BoundedReads(n, self.options.timeout_s, self.options.path)
        self._guard.open()
        if state.check is not None:
            state.check.start()

    def _trust_saved_index(self, trimmed: Evicted) -> SavedIndexCheck:
        """The index is the saved rows alone (no file listed or opened), capacity trimmed;
        returns the background check that then compares it with the directory (and counts
        the other fingerprints' files it lists)."""
        index = self._state.index
        trusted = index.key_set()
        log.info(
            "disk tier %s: %d chunks (%s) from the saved index, %d evicted to fit %s; "
            "checking them against the directory in the background",
            self.options.path,
            len(index),
            format_size(index.used_bytes),
            len(trimmed),
            format_size(self.capacity_bytes),
        )
        return SavedIndexCheck(self, trusted)

    def index_checked(self, timeout: float | None = None) -> bool:
        """True once the background check of a saved index has ended (at once when the open
        read the headers instead); False at the timeout."""
        check = self._state.check
        return check is None or check.wait(timeout)

    def close(self) -> None:
        """Refuse new calls, wait (bounded) for running ones, drain queued writes (each
        still completes), stop the threads. Idempotent. Never waits on a stuck reader."""
        state = self._state
        timeout = self.options.timeout_s
        calls_done = self._guard.close(timeout)
        with state.lock:
            if self._reader is None:
                return  # never opened, or closed already
            reader, self._reader = self._reader, None
        # The saved-index check first: it stops at its next file (a stuck filesystem aside).
        check_done = state.check is None or state.check.stop(timeout)
        writes_done = self._writes.queue.close(timeout)
        reader.close()
        stalled = reader.stalled
        clean = calls_done and writes_done and check_done and not stalled
        with state.lock:
            if state.budget is not None:  # its files are released: others may evict them
                state.budget.leave(self)
            if self._quotas is not None:  # saved only when clean, as the index is
                self._quotas.close(save=clean)
        if clean:
            state.save_index()
        else:
            log.warning(
                "disk tier %s closed with %d calls, %d reads, %s writes and %s index check "
                "still running after %.1fs (a stuck filesystem?); their directory descriptors "
                "stay open",
                self.options.path,
                self._guard.running,
                stalled,
                "some" if not writes_done else "no",
                "its" if not check_done else "no",
                timeout,
            )
        state.dir.close(keep_open=not clean)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writes.queue.flush(timeout)

    # -- what the saved-index check uses (kvtier.storage.disk.reconcile.CheckHost) ---------
    @property
    def index_lock(self) -> threading.Lock:
        return self._state.lock

    @property
    def index(self) -> DiskIndex:
        return self._state.index

    def is_writing(self, key: ChunkKey) -> bool:
        return self._writes.queue.holds(key)

    def directory(self) -> tuple[int, int]:
        return self._state.dir.generation, self._state.dir.fd

    def evict_to_fit(self) -> Evicted:
        """Under the lock: trim the directory to its budget (see DiskState.evict_to_fit)."""
        return self._state.evict_to_fit()

    def add_released(self, found: Sequence[files.OtherFile]) -> None:
        """Under the lock: other fingerprints' files a listing found (the budget counts
        those no open tier owns)."""
        self._state.add_released(found)

    def checked(self, temp_removed: int, bad_removed: int, gone: int) -> None:
        self.counters.temp_removed += temp_removed
        self.counters.bad_removed_at_open += bad_removed
        self.counters.corrupt += bad_removed
        if bad_removed:
            log.warning("disk tier removed %d files with a bad header or length", bad_removed)

    # -- what the directory's budget uses (kvtier.storage.disk.budget.BudgetMember) --------
    @property
    def configured_bytes(self) -> int:
        return self.options.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """The directory's budget (the smallest configured by its open tiers)."""
        return self._state.capacity_bytes

    def drop_evicted(self, keys: Sequence[ChunkKey]) -> None:
        """Under the lock: the budget took ``keys`` from the index; delete their files."""
        self._state.unlink(keys)
        self.counters.evicted += len(keys)
        self.counters.pinned_keys = self._state.index.pinned_keys

    # -- tenant_quotas (kvtier.storage.disk.quotas) ------------------------------------------
    def attach_quotas(self, quotas: TenantQuotas) -> None:
        """Keep ``quotas`` (the engine's table) per tenant; before :meth:`open` only."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError("disk tier quotas are attached before it opens")
        unit = HEADER_SIZE + self.layout.payload_bytes(self.fingerprint.chunk_size)
        self._quotas = DiskQuotas(self._state, quotas, unit)
        self.tenants = self._quotas.policy

    # -- writes and reads (kvtier.storage.disk.writes, kvtier.storage.disk.reads) ----------
    def put(self, job: PutJob) -> None:
        try:
            with self._guard.call():
                self._writes.put(job)
        except StateError as exc:
            with self._state.lock:
                self.counters.failed += 1
            complete(job.on_done, PutResult(job.key, PutOutcome.FAILED, str(exc)))

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        state = self._state
        with self._guard.call():
            state.check_directory()
            with state.lock:
                if state.dir.lost:
                    return [False] * len(keys)
                return [k in state.index for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        with self._guard.call():
            return self._read_bounded([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        """Reads of one lookup, overlapped on the reader pool (I/O and hashing drop the GIL)."""
        with self._guard.call():
            if len(items) > 1:
                with self._state.lock:
                    self.counters.batched_reads += len(items)
            return self._read_bounded(items)

    def _read_bounded(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        assert self._reader is not None
        return self._reads.read(self._reader, items)

    # -- pins, removal, usage --------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        return self.pin_many((key,)) == 1

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        index = self._state.index
        with self._guard.call(), self._state.lock:
            pinned = 0
            for key in keys:
                if not index.pin(key):
                    break
                pinned += 1
            index.touch(keys[:pinned])  # one use of the run (its reads do not touch)
            self.counters.pinned_keys = index.pinned_keys
            return pinned

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        with self._guard.call(), self._state.lock:
            self._state.index.touch(keys)

    def unpin(self, key: ChunkKey) -> None:
        self.unpin_many((key,))

    def unpin_many(self, keys: Sequence[ChunkKey]) -> None:
        index = self._state.index
        with self._state.lock:
            for key in keys:
                if not index.unpin(key):
                    log.debug("unpin of %s, which holds no pin: ignored", key.hex())
            self.counters.pinned_keys = index.pinned_keys

    def remove(self, key: ChunkKey) -> bool:
        state = self._state
        with self._guard.call(), state.lock:
            if state.index.pop(key) is None:
                return False
            self.counters.pinned_keys = state.index.pinned_keys
            state.unlink([key])
            self.report_removed((key,))
        return True

    def usage(self) -> TierUsage:
        """Also refreshes the gauges the write queue and the readers own."""
        state = self._state
        with state.lock:
            self.counters.inflight_bytes = self._writes.queue.inflight_bytes
            if self._reader is not None:
                self.counters.read_timeouts = self._reader.timeouts
                self.counters.stalled_reads = self._reader.stalled
            return TierUsage(state.index.used_bytes, self.capacity_bytes, len(state.index))

    def clear(self) -> int:
        state = self._state
        with self._guard.call(), state.lock:
            victims = state.index.unpinned_keys()
            for key in victims:
                state.index.pop(key)
            state.unlink(victims)
            self.report_removed(victims)
        return len(victims)

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._state.lock:
            return self._state.index.is_pinned(key)
