"""The disk tier: one checksummed record file per chunk, crash-safe, rebuilt at every open.

Protocol (on top of :mod:`kvtier.storage.base`)::

    put(key, payload, n, on_done)
      closed                                   -> on_done(FAILED)            at once
      key on disk or being written             -> on_done(EXISTS)            at once
      record larger than the directory budget  -> on_done(DROPPED), counted  at once
      refused by the write queue's admission   -> on_done(DROPPED), counted  at once (never waits)
        (bytes in flight + record > disk_max_inflight_bytes, see storage/write_queue.py)
      else queued on the write queue; a writer thread then:
        reserves room in the directory's budget (evicting released models' files, then
        the open tiers' unpinned policy victims), or on_done(DROPPED) if all are pinned
        writes temp name, fsync, rename, fsync dir  -> on_done(STORED)
        OSError (ENOSPC, EIO, ...)                  -> on_done(FAILED), counted, temp removed

Membership (``Tier.add_membership_listener``, what KV events publish): a chunk is added when
its write commits (never when queued), and removed when evicted, removed, cleared, found
corrupt or vanished on a read, named by the saved index but gone, or when the directory is
lost (all of them at once).

``on_done`` runs exactly once per put, before the put stops counting as in flight, so once
:meth:`flush` returns every callback has run (the storage manager's staging pages are back).
The payload page is read, never written, until then. Files evicted to make room are reported
to the eviction listeners (``Tier.add_evict_listener``) once they are unlinked.

Writes encode the payload with the tier's codec (``codec``, identity by default: the page
itself is written, no copy; :mod:`kvtier.storage.codecs`). Reads decode whatever registered
codec a file names. An identity file is read straight into the caller's page (``preadv``, in
1 MiB pieces each hashed right after it lands, so the checksum costs no second pass over
memory); another codec's stored bytes land in a scratch buffer, hashed the same way, and are
decoded into the page once their checksum matches. A mismatch, a bad header or a wrong
length is a miss: logged, file removed, counted in ``counters.corrupt``; a file of another
format version or of an unknown codec too, logged once per 30 s
(:mod:`kvtier.storage.records`).

A clean close saves the index (:mod:`~kvtier.storage.disk.snapshot`). An open with a usable
saved index builds the index from it alone and serves at once; a background check
(:mod:`~kvtier.storage.disk.reconcile`) then lists the directory, adds the files the saved
index does not name, drops the entries whose file is gone and removes
leftovers. The files stay the truth: every read checks its file, so a trusted entry whose
file is gone or corrupt is a miss. Without a saved index (or with a torn one) the open
rebuilds the index from the headers (oldest file first, by mtime, which writes and read hits
set), deletes temporary leftovers of this fingerprint, and removes and counts bad files.

Faults (docs/disk.md): reads are bounded by ``blocking_timeout_secs``
(:mod:`~kvtier.storage.disk.bounded_reads`); a chunk name that is not a regular file (a
FIFO) is a corrupt miss (:mod:`~kvtier.storage.disk.files`); a deleted directory drops the
index and is re-opened when usable (:mod:`~kvtier.storage.disk.directory`); :meth:`close`
waits for calls in flight, bounded, and never on a stuck reader.

Capacity is per directory, not per tier (:mod:`~kvtier.storage.disk.budget`): every disk
tier of this process open on one directory shares one budget and one lock (the tier's own
until :meth:`DiskTier.open`), and a write may evict another fingerprint's files. Files
evicted from another tier are reported to that tier's listeners.

Settings: :mod:`kvtier.storage.disk.options`.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.config import Config
from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError, CorruptRecord, StateError, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.base import OnDone, PutOutcome, PutResult, Tier, TierCounters, TierUsage
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.disk import budget, files, snapshot
from kvtier.storage.disk.bounded_reads import BoundedReads
from kvtier.storage.disk.budget import DirectoryBudget, Evicted
from kvtier.storage.disk.directory import ChunkDirectory
from kvtier.storage.disk.index import DiskEntry, DiskIndex
from kvtier.storage.disk.options import DiskOptions, options_from_config
from kvtier.storage.disk.reconcile import SavedIndexCheck
from kvtier.storage.policy import make_policy
from kvtier.storage.records import HEADER_SIZE, encode_parts, finish_read, payload_hasher
from kvtier.storage.write_queue import Write, WriteQueue, complete

log = logging.getLogger(__name__)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass
class DiskCounters(TierCounters):
    """The disk tier's own counts, beside every tier's (changed under the tier's lock)."""

    dropped_inflight: int = 0  # refused by the write queue: a slow disk throttles stores
    dropped_too_large: int = 0  # one record larger than the whole capacity
    dropped_no_room: int = 0  # every file is pinned: nothing to evict
    no_space: int = 0  # ENOSPC / EDQUOT / EFBIG while writing
    read_errors: int = 0  # an OSError while reading (counted as a miss)
    batched_reads: int = 0  # chunks read through get_many_into (overlapped on the reader pool)
    temp_removed: int = 0  # leftovers of interrupted writes, deleted at open
    bad_removed_at_open: int = 0  # files with a bad header or length, deleted at open
    pinned_keys: int = 0  # gauge: keys pinned now
    inflight_bytes: int = 0  # gauge: bytes queued or being written (as of the last usage())
    read_timeouts: int = 0  # reads past blocking_timeout_secs (a stuck filesystem): misses
    stalled_reads: int = 0  # gauge: such reads still running
    directory_lost: int = 0  # the directory was deleted (or became unusable) while open
    directory_reopened: int = 0  # ... and was re-opened once usable again
    available: int = 1  # gauge: 0 while the directory is lost


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
        self.counters = DiskCounters()
        self._index = DiskIndex(options.capacity_bytes, make_policy(options.cache_policy))
        # Until open: the tier's own. From open: its directory's (kvtier.storage.disk.budget),
        # shared by every disk tier of this process on that directory.
        self._lock = threading.Lock()
        self._budget: DirectoryBudget | None = None
        self._opening = False
        self._reopen_evicted: Evicted | None = None
        # A full disk / Redis at maxmemory fails every chunk: one line per 30 s, with a count.
        self._repeated = RepeatedLog(log)
        self._guard = CallGuard("disk tier")
        self._dir = ChunkDirectory(options.path, self.fp_hex)
        self._writes = WriteQueue(
            options.io_threads, options.max_inflight_bytes, self._write, "kvtier-disk-write"
        )
        self._reader: BoundedReads | None = None
        self._check: SavedIndexCheck | None = None  # set by an open from a saved index

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
        with self._lock:
            if self._guard.state is not Lifecycle.NEW or self._opening:
                raise StateError(f"disk tier is {self._guard.state.value}; open it once")
            self._opening = True
        try:
            dir_fd = self._dir.open()
            try:
                shared = budget.of_directory(dir_fd, self.options.path)
                rows = snapshot.load_rows(dir_fd, self.fingerprint)
                found = self._scan(dir_fd) if rows is None else None
                if rows is not None:
                    self._index.add_rows(rows)
            except OSError as exc:
                self._dir.close()
                raise ConfigError(
                    "local_disk", self.options.path, f"a readable directory ({exc.strerror})"
                ) from None
        except BaseException:
            self._opening = False
            raise
        self._budget, self._lock = shared, shared.lock  # nothing else uses the tier yet
        with self._lock:
            shared.join(self)
            if found is not None:
                shared.add_released(found.others)
            trimmed = self.evict_to_fit()
            if found is not None:
                self._log_scan(found, trimmed)
            else:
                self._check = self._trust_saved_index(trimmed)
        trimmed.report()
        self._writes.open()
        n = self.options.io_threads
        self._reader = BoundedReads(n, self.options.timeout_s, self.options.path)
        self._guard.open()
        if self._check is not None:
            self._check.start()

    def _trust_saved_index(self, trimmed: Evicted) -> SavedIndexCheck:
        """The index is the saved rows alone (no file listed or opened), capacity trimmed;
        returns the background check that then compares it with the directory (and counts
        the other fingerprints' files it lists)."""
        trusted = self._index.key_set()
        log.info(
            "disk tier %s: %d chunks (%s) from the saved index, %d evicted to fit %s; "
            "checking them against the directory in the background",
            self.options.path,
            len(self._index),
            format_size(self._index.used_bytes),
            len(trimmed),
            format_size(self.capacity_bytes),
        )
        return SavedIndexCheck(self, trusted)

    def index_checked(self, timeout: float | None = None) -> bool:
        """True once the background check of a saved index has ended (at once when the open
        read the headers instead); False at the timeout."""
        check = self._check
        return check is None or check.wait(timeout)

    # -- what the saved-index check uses (kvtier.storage.disk.reconcile.CheckHost) ---------
    @property
    def index_lock(self) -> threading.Lock:
        return self._lock

    @property
    def index(self) -> DiskIndex:
        return self._index

    def is_writing(self, key: ChunkKey) -> bool:
        return self._writes.holds(key)

    def directory(self) -> tuple[int, int]:
        return self._dir.generation, self._dir.fd

    def evict_to_fit(self) -> Evicted:
        """Under the lock: evict (released files first, then the tiers' policy victims)
        until the directory fits its budget (it may have shrunk since the files were
        written, or hold other fingerprints' files); the files are unlinked. The caller
        reports the evictions once it lets go of the lock."""
        assert self._budget is not None
        return self._budget.trim(self)

    def add_released(self, found: Sequence[files.OtherFile]) -> None:
        """Under the lock: other fingerprints' files a listing found (the budget counts
        those no open tier owns)."""
        assert self._budget is not None
        self._budget.add_released(found)

    # -- what the directory's budget uses (kvtier.storage.disk.budget.BudgetMember) --------
    @property
    def configured_bytes(self) -> int:
        return self.options.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """The directory's budget (the smallest configured by its open tiers)."""
        return self.options.capacity_bytes if self._budget is None else self._budget.capacity_bytes

    def drop_evicted(self, keys: Sequence[ChunkKey]) -> None:
        """Under the lock: the budget took ``keys`` from the index; delete their files."""
        self._unlink(keys)
        self.counters.evicted += len(keys)
        self.counters.pinned_keys = self._index.pinned_keys

    def checked(self, temp_removed: int, bad_removed: int, gone: int) -> None:
        self.counters.temp_removed += temp_removed
        self.counters.bad_removed_at_open += bad_removed
        self.counters.corrupt += bad_removed
        if bad_removed:
            log.warning("disk tier removed %d files with a bad header or length", bad_removed)

    def _scan(self, dir_fd: int) -> files.ScanResult:
        """Index this fingerprint's files from the headers (a saved index's entries that are
        listed need none), oldest first; nothing trimmed yet."""
        saved = snapshot.load(dir_fd, self.fingerprint) or {}
        found = files.scan(dir_fd, self.fingerprint, self.fp_hex, saved)
        for entry in saved.values():  # next victim first, as saved
            if entry.key in found.known_present:
                self._index.add(entry.key, DiskEntry(entry.num_tokens, entry.file_bytes))
        for record in found.records:  # files the snapshot does not know, oldest first
            self._index.add(
                record.key, DiskEntry(record.header.num_tokens, record.header.record_len)
            )
        self.counters.temp_removed += found.temp_removed
        self.counters.bad_removed_at_open += found.bad_removed
        self.counters.corrupt += found.bad_removed
        return found

    def _rebuild_index(self, dir_fd: int) -> None:
        """A lost directory is back (under the lock): index it again, trim to the budget."""
        found = self._scan(dir_fd)
        self.add_released(found.others)
        trimmed = self.evict_to_fit()
        self._log_scan(found, trimmed)
        self._reopen_evicted = trimmed  # reported by _try_reopen, out of the lock

    def _log_scan(self, found: files.ScanResult, trimmed: Evicted) -> None:
        log.info(
            "disk tier %s: %d chunks (%s) found (%d from the saved index, %d headers read), "
            "%d evicted to fit %s, %d temporary and %d bad "
            "files removed",
            self.options.path,
            len(self._index),
            format_size(self._index.used_bytes),
            len(found.known_present),
            len(found.records),
            len(trimmed),
            format_size(self.capacity_bytes),
            found.temp_removed,
            found.bad_removed,
        )
        if found.bad_removed:
            log.warning("disk tier removed %d files with a bad header or length", found.bad_removed)

    def close(self) -> None:
        """Refuse new calls, wait (bounded) for running ones, drain queued writes (each
        still completes), stop the threads. Idempotent. Never waits on a stuck reader."""
        timeout = self.options.timeout_s
        calls_done = self._guard.close(timeout)
        with self._lock:
            if self._reader is None:
                return  # never opened, or closed already
            reader, self._reader = self._reader, None
        # The saved-index check first: it stops at its next file (a stuck filesystem aside).
        check_done = self._check is None or self._check.stop(timeout)
        writes_done = self._writes.close(timeout)
        reader.close()
        stalled = reader.stalled
        clean = calls_done and writes_done and check_done and not stalled
        with self._lock:
            if self._budget is not None:  # its files are released: others may evict them
                self._budget.leave(self)
        if clean:
            self._save_index()
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
        self._dir.close(keep_open=not clean)

    def _save_index(self) -> None:
        """Save the index for the next open (kvtier.storage.disk.snapshot); never raises.
        Packed from the index under the lock, as it is iterated (the close: nothing else
        runs by now)."""
        with self._lock:
            if self._dir.lost:
                return
            rows = ((k, e.num_tokens, e.file_bytes) for k, e in self._index.items())
            try:
                snapshot.save_rows(self._dir.fd, self.fingerprint, rows, len(self._index))
            except OSError as exc:
                log.warning(
                    "disk tier %s: index not saved (%s); the next open scans",
                    self.options.path,
                    exc,
                )

    def flush(self, timeout: float | None = None) -> bool:
        return self._writes.flush(timeout)

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        try:
            with self._guard.call():
                self._put(key, payload, num_tokens, on_done)
        except StateError as exc:
            with self._lock:
                self.counters.failed += 1
            complete(on_done, PutResult(key, PutOutcome.FAILED, str(exc)))

    def _put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        nbytes = HEADER_SIZE + payload.numel()
        refused: PutResult | None = None
        if self._dir.lost:
            self._try_reopen()
        with self._lock:
            if self._dir.lost:
                refused = PutResult(
                    key, PutOutcome.DROPPED, f"disk directory {self.options.path} is gone"
                )
                self.counters.dropped += 1
            elif key in self._index or self._writes.holds(key):
                refused = PutResult(key, PutOutcome.EXISTS)
            elif nbytes > self.capacity_bytes:
                refused = PutResult(
                    key,
                    PutOutcome.DROPPED,
                    f"chunk file of {nbytes} bytes is larger than max_local_disk_size "
                    f"({self.capacity_bytes} bytes for the directory)",
                )
                self.counters.dropped += 1
                self.counters.dropped_too_large += 1
            else:
                # Under the guard: close() drains the queue only after this.
                why = self._writes.submit(Write(key, payload, num_tokens, nbytes, on_done))
                if why:
                    refused = PutResult(key, PutOutcome.DROPPED, why)
                    self.counters.dropped += 1
                    self.counters.dropped_inflight += 1
        if refused is not None:
            if refused.outcome is PutOutcome.DROPPED:
                log.debug("disk put of %s dropped: %s", key.hex(), refused.detail)
            complete(on_done, refused)

    def _write(self, write: Write) -> PutResult:
        """Runs on a writer thread (the queue completes ``on_done`` with what it returns)."""
        try:
            return self._write_record(write.key, write.payload, write.num_tokens)
        except Exception:
            log.exception("disk write of %s failed unexpectedly", write.key.hex())
            with self._lock:
                self.counters.failed += 1
            return PutResult(write.key, PutOutcome.FAILED, "disk writer failed unexpectedly")

    def _write_record(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int) -> PutResult:
        """The file holds the header and the codec's stored bytes, and the index counts what
        the file holds (the write queue counted header + payload in flight)."""
        header, stored = encode_parts(key, self.fingerprint, num_tokens, payload, self.codec)
        nbytes = HEADER_SIZE + stored.nbytes
        with self._lock:
            if self._dir.lost:
                self.counters.dropped += 1
                return PutResult(key, PutOutcome.DROPPED, "disk directory is gone")
            generation, dir_fd = self._dir.generation, self._dir.fd
            assert self._budget is not None
            evicted = self._budget.reserve(self, nbytes)  # files unlinked, counted
            if evicted is None:
                self.counters.dropped += 1
                self.counters.dropped_no_room += 1
                return PutResult(key, PutOutcome.DROPPED, "disk directory is full of pinned chunks")
        evicted.report()
        try:
            files.write_record(dir_fd, key, self.fp_hex, header, stored)
        except OSError as exc:
            with self._lock:
                self._index.cancel(nbytes)
                self.counters.failed += 1
                if exc.errno in _NO_SPACE:
                    self.counters.no_space += 1
            if exc.errno == errno.ENOENT:
                self._check_directory()  # the directory itself gone? (logged there)
            if not self._dir.lost:
                self._repeated.warning(
                    ("write", exc.errno),
                    "disk write of chunk %s failed (%s); it is not stored",
                    key.hex(),
                    exc,
                )
            return PutResult(key, PutOutcome.FAILED, f"disk write failed: {exc}")
        with self._lock:
            if generation != self._dir.generation:  # landed in a directory lost meanwhile
                self._index.cancel(nbytes)
                self.counters.failed += 1
                return PutResult(key, PutOutcome.FAILED, "disk directory was lost meanwhile")
            self._index.commit(key, DiskEntry(num_tokens, nbytes))
            if self._check is not None:
                self._check.written(key)
            self.counters.stored += 1
            self.counters.bytes_written += nbytes
            self.report_added((key,))  # landed: under the lock, before any removal of it
        return PutResult(key, PutOutcome.STORED)

    # -- reads -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._guard.call():
            self._check_directory()
            with self._lock:
                if self._dir.lost:
                    return [False] * len(keys)
                return [k in self._index for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        with self._guard.call():
            return self._read_bounded([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        """Reads of one lookup, overlapped on the reader pool (I/O and hashing drop the GIL)."""
        with self._guard.call():
            if len(items) > 1:
                with self._lock:
                    self.counters.batched_reads += len(items)
            return self._read_bounded(items)

    def _read_bounded(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        """The reads, bounded by the timeout (see kvtier.storage.disk.bounded_reads)."""
        assert self._reader is not None
        results = None if self._dir.lost else self._reader.read(self._read_one, items)
        if results is None:  # the directory is gone, or a stuck read stalls the tier
            with self._lock:
                self.counters.misses += len(items)
            return [None] * len(items)
        return results

    def _read_one(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        """One read, on a reader thread (the caller waits on it, bounded)."""
        with self._lock:
            # A pinned key was touched when its lookup pinned it: touching it again per read
            # would reorder a run parent-first (the policy wants one touch per use).
            entry = self._index.get(key, touch=not self._index.is_pinned(key))
            dir_fd = self._dir.fd
            if entry is None:
                self.counters.misses += 1
                return None
        payload_len = self.fingerprint.layout.payload_bytes(entry.num_tokens)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < payload_len:
            raise ValueError(f"out must be a flat uint8 tensor of >= {payload_len} bytes")
        target = out[:payload_len]
        hasher = payload_hasher()  # fed piece by piece as the stored bytes land: one pass
        try:
            found = files.read_record_into(
                dir_fd, key, self.fingerprint, self.fp_hex, target, hasher.update
            )
            header = None
            if found is not None:
                header, stored = found
                finish_read(header, hasher.digest(), stored, target, self.fingerprint.layout)
        except UnknownRecordFormat as exc:
            # Comes in crowds (every file of the kvtier before an upgrade): one line per 30 s.
            self._repeated.warning(
                "format",
                "disk chunk %s is in a format this kvtier does not read (%s): removed, "
                "counted as a corrupt miss",
                key.hex(),
                exc,
            )
            self.note_corrupt(key, str(exc))
            self._forget(key, corrupt=True)
            return None
        except CorruptRecord as exc:
            log.warning("disk chunk %s is corrupt (%s): removed, counted as a miss", key.hex(), exc)
            self.note_corrupt(key, str(exc))
            self._forget(key, corrupt=True)
            return None
        except OSError as exc:
            log.warning("disk read of chunk %s failed (%s): counted as a miss", key.hex(), exc)
            with self._lock:
                self.counters.misses += 1
                self.counters.read_errors += 1
            return None
        if header is None:  # the file vanished under us (removed by hand, or evicted)
            self._forget(key, corrupt=False)
            self._check_directory()  # ... or with its whole directory
            return None
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += header.payload_len
        files.touch(dir_fd, self.fp_hex, key)  # the next open restores this recency
        return header.num_tokens

    # -- a directory deleted under us ------------------------------------------------------
    def _check_directory(self) -> None:
        """Notice a deleted directory; try to re-open a lost one (module docstring)."""
        if self._dir.lost:
            self._try_reopen()
        elif self._dir.deleted():
            self._mark_lost("was deleted")

    def _mark_lost(self, why: str) -> None:
        with self._lock:
            if not self._dir.mark_lost():
                return
            gone = list(self._index.key_set())
            dropped = self._index.drop_all()
            self.report_removed(gone)
            self.counters.directory_lost += 1
            self.counters.available = 0
            self.counters.pinned_keys = 0
        log.warning(
            "disk tier directory %s %s: the tier is unavailable (lookups miss, stores are "
            "dropped) and its index of %d chunks is dropped; it re-opens the path when usable",
            self.options.path,
            why,
            dropped,
        )

    def _try_reopen(self) -> None:
        if not self._dir.try_reopen(self._rebuild_index, self._lock):
            return
        with self._lock:
            self.counters.available = 1
            self.counters.directory_reopened += 1
            evicted, self._reopen_evicted = self._reopen_evicted, None
        if evicted is not None:
            evicted.report()
        log.info("disk tier directory %s is usable again: re-opened", self.options.path)

    def _unlink(self, keys: Sequence[ChunkKey]) -> None:
        """Delete the files of keys just dropped from the index. Called under the lock, so no
        put of the same key can start (and land its new file) before the old one is gone."""
        for key in keys:
            files.unlink_quietly(self._dir.fd, files.final_name(self.fp_hex, key))

    def _forget(self, key: ChunkKey, *, corrupt: bool) -> None:
        with self._lock:
            if self._index.pop(key) is not None:
                self.report_removed((key,))
            self.counters.misses += 1
            if corrupt:
                self.counters.corrupt += 1
            self.counters.pinned_keys = self._index.pinned_keys
            if corrupt:
                self._unlink([key])

    # -- pins, removal, usage --------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        return self.pin_many((key,)) == 1

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        with self._guard.call(), self._lock:
            pinned = 0
            for key in keys:
                if not self._index.pin(key):
                    break
                pinned += 1
            self._index.touch(keys[:pinned])  # one use of the run (its reads do not touch)
            self.counters.pinned_keys = self._index.pinned_keys
            return pinned

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        with self._guard.call(), self._lock:
            self._index.touch(keys)

    def unpin(self, key: ChunkKey) -> None:
        self.unpin_many((key,))

    def unpin_many(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                if not self._index.unpin(key):
                    log.debug("unpin of %s, which holds no pin: ignored", key.hex())
            self.counters.pinned_keys = self._index.pinned_keys

    def remove(self, key: ChunkKey) -> bool:
        with self._guard.call(), self._lock:
            if self._index.pop(key) is None:
                return False
            self.counters.pinned_keys = self._index.pinned_keys
            self._unlink([key])
            self.report_removed((key,))
        return True

    def usage(self) -> TierUsage:
        """Also refreshes the gauges the write queue and the readers own."""
        with self._lock:
            self.counters.inflight_bytes = self._writes.inflight_bytes
            if self._reader is not None:
                self.counters.read_timeouts = self._reader.timeouts
                self.counters.stalled_reads = self._reader.stalled
            return TierUsage(self._index.used_bytes, self.capacity_bytes, len(self._index))

    def clear(self) -> int:
        with self._guard.call(), self._lock:
            victims = self._index.unpinned_keys()
            for key in victims:
                self._index.pop(key)
            self._unlink(victims)
            self.report_removed(victims)
        return len(victims)

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._index.is_pinned(key)
