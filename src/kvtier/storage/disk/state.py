"""What the parts of one disk tier share, and keeping its index true to its directory.

:class:`~kvtier.storage.disk.tier.DiskTier` is the front; its write path
(:mod:`~kvtier.storage.disk.writes`) and read path (:mod:`~kvtier.storage.disk.reads`) work
on this same state. All of it is read and changed under :attr:`DiskState.lock`, which is the
tier's own until the open and its directory's budget's from then on
(:mod:`~kvtier.storage.disk.budget`): read the lock from the state each time, never keep it.

The index against the directory: built from the headers (oldest file first, by mtime) when
there is no usable saved index, saved for the next open at a clean close
(:mod:`~kvtier.storage.disk.snapshot`). A deleted directory
(:mod:`~kvtier.storage.disk.directory`) drops the whole index, every chunk reported removed,
and the tier is unavailable (lookups miss, stores are dropped) until a call finds the path
usable again: it is re-opened, indexed from the headers and trimmed to the budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from kvtier.config.sizes import format_size
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.codecs import PayloadCodec
from kvtier.storage.disk import files, snapshot
from kvtier.storage.disk.budget import BudgetMember, DirectoryBudget, Evicted
from kvtier.storage.disk.counters import DiskCounters
from kvtier.storage.disk.directory import ChunkDirectory
from kvtier.storage.disk.index import DiskEntry, DiskIndex
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.reconcile import SavedIndexCheck
from kvtier.storage.policy import make_policy

log = logging.getLogger(__name__)


class TenantCharges(Protocol):
    """What the writes ask of the tier's side of ``tenant_quotas`` (``DiskQuotas``, built on
    this module: a Protocol keeps the import one way). Both under the lock."""

    def expect(self, key: ChunkKey, tenant: str) -> None: ...

    def charge(self, key: ChunkKey) -> list[ChunkKey]: ...


class StateOwner(BudgetMember, Protocol):
    """The disk tier as its state sees it: its place in the directory's budget, and the
    listeners it tells (:class:`~kvtier.storage.base.Tier`)."""

    def report_added(self, keys: Sequence[ChunkKey]) -> None: ...  # under the lock

    def report_removed(self, keys: Sequence[ChunkKey]) -> None: ...

    def note_corrupt(self, key: ChunkKey, reason: str) -> None: ...


class DiskState:
    """One disk tier's index, counters, directory and budget, under one lock."""

    def __init__(
        self,
        owner: StateOwner,
        options: DiskOptions,
        fingerprint: Fingerprint,
        codec: PayloadCodec,
    ) -> None:
        self.owner = owner
        self.options = options
        self.fingerprint = fingerprint  # the tier's: a lossy codec's own namespace
        self.fp_hex = fingerprint.hex()
        self.codec = codec  # what writes encode with; reads decode any registered codec
        self.counters = DiskCounters()
        self.index = DiskIndex(options.capacity_bytes, make_policy(options.cache_policy))
        # Until open: the tier's own. From open: its directory's (kvtier.storage.disk.budget),
        # shared by every disk tier of this process on that directory.
        self.lock = threading.Lock()
        self.budget: DirectoryBudget | None = None
        self.dir = ChunkDirectory(options.path, self.fp_hex)
        self.check: SavedIndexCheck | None = None  # set by an open from a saved index
        self.quotas: TenantCharges | None = None  # tenant_quotas (kvtier.storage.disk.quotas)
        self._reopen_evicted: Evicted | None = None

    @property
    def capacity_bytes(self) -> int:
        """The directory's budget (the smallest configured by its open tiers)."""
        return self.options.capacity_bytes if self.budget is None else self.budget.capacity_bytes

    def unlink(self, keys: Sequence[ChunkKey]) -> None:
        """Delete the files of keys just dropped from the index. Called under the lock, so no
        put of the same key can start (and land its new file) before the old one is gone."""
        for key in keys:
            files.unlink_quietly(self.dir.fd, files.final_name(self.fp_hex, key))

    def evict_to_fit(self) -> Evicted:
        """Under the lock: evict (released files first, then the tiers' policy victims)
        until the directory fits its budget (it may have shrunk since the files were
        written, or hold other fingerprints' files); the files are unlinked. The caller
        reports the evictions once it lets go of the lock."""
        assert self.budget is not None
        return self.budget.trim(self.owner)

    def add_released(self, found: Sequence[files.OtherFile]) -> None:
        """Under the lock: other fingerprints' files a listing found (the budget counts
        those no open tier owns)."""
        assert self.budget is not None
        self.budget.add_released(found)

    # -- the index against the directory -------------------------------------------------
    def scan(self, dir_fd: int) -> files.ScanResult:
        """Index this fingerprint's files from the headers (a saved index's entries that are
        listed need none), oldest first; nothing trimmed yet."""
        saved = snapshot.load(dir_fd, self.fingerprint) or {}
        found = files.scan(dir_fd, self.fingerprint, self.fp_hex, saved)
        for entry in saved.values():  # next victim first, as saved
            if entry.key in found.known_present:
                self.index.add(entry.key, DiskEntry(entry.num_tokens, entry.file_bytes))
        for record in found.records:  # files the snapshot does not know, oldest first
            self.index.add(
                record.key, DiskEntry(record.header.num_tokens, record.header.record_len)
            )
        self.counters.temp_removed += found.temp_removed
        self.counters.bad_removed_at_open += found.bad_removed
        self.counters.corrupt += found.bad_removed
        return found

    def log_scan(self, found: files.ScanResult, trimmed: Evicted) -> None:
        log.info(
            "disk tier %s: %d chunks (%s) found (%d from the saved index, %d headers read), "
            "%d evicted to fit %s, %d temporary and %d bad "
            "files removed",
            self.options.path,
            len(self.index),
            format_size(self.index.used_bytes),
            len(found.known_present),
            len(found.records),
            len(trimmed),
            format_size(self.capacity_bytes),
            found.temp_removed,
            found.bad_removed,
        )
        if found.bad_removed:
            log.warning("disk tier removed %d files with a bad header or length", found.bad_removed)

    def save_index(self) -> None:
        """Save the index for the next open (kvtier.storage.disk.snapshot); never raises.
        Packed from the index under the lock, as it is iterated (the close: nothing else
        runs by now)."""
        with self.lock:
            if self.dir.lost:
                return
            rows = ((k, e.num_tokens, e.file_bytes) for k, e in self.index.items())
            try:
                snapshot.save_rows(self.dir.fd, self.fingerprint, rows, len(self.index))
            except OSError as exc:
                log.warning(
                    "disk tier %s: index not saved (%s); the next open scans",
                    self.options.path,
                    exc,
                )

    # -- a directory deleted under us ------------------------------------------------------
    def check_directory(self) -> None:
        """Notice a deleted directory; try to re-open a lost one (module docstring)."""
        if self.dir.lost:
            self.try_reopen()
        elif self.dir.deleted():
            self._mark_lost("was deleted")

    def _mark_lost(self, why: str) -> None:
        with self.lock:
            if not self.dir.mark_lost():
                return
            gone = list(self.index.key_set())
            dropped = self.index.drop_all()
            self.owner.report_removed(gone)
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

    def try_reopen(self) -> None:
        if not self.dir.try_reopen(self._rebuild_index, self.lock):
            return
        with self.lock:
            self.counters.available = 1
            self.counters.directory_reopened += 1
            evicted, self._reopen_evicted = self._reopen_evicted, None
        if evicted is not None:
            evicted.report()
        log.info("disk tier directory %s is usable again: re-opened", self.options.path)

    def _rebuild_index(self, dir_fd: int) -> None:
        """A lost directory is back (under the lock): index it again, trim to the budget."""
        found = self.scan(dir_fd)
        self.add_released(found.others)
        trimmed = self.evict_to_fit()
        self.log_scan(found, trimmed)
        self._reopen_evicted = trimmed  # reported by try_reopen, out of the lock
