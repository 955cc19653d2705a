"""The disk tier's background check of a trusted saved index against its directory.

An open with a usable saved index (:mod:`~kvtier.storage.disk.snapshot`) builds the index
from it alone and serves at once: listing a million names costs seconds, reading their
headers a minute. This check then runs on its own thread, once::

    listed, named by the saved index      nothing to do (trusted since the open)
    listed, not in the index              header read and checked; added (oldest first, by
                                          mtime) or, when bad, the file removed
    a temporary leftover                  removed, unless this process made it (a write of
                                          ours may be running)
    in the saved index, not listed        dropped from the index (the file is gone), unless
                                          pinned or written again since the open
    another fingerprint's chunk file      counted by the directory's budget (released, when
                                          no tier here has it open), which then trims the
                                          directory (:mod:`~kvtier.storage.disk.budget`)

Why trusting first is safe: a trusted entry is only a claim that a file exists under the
name its key and fingerprint determine. Every read opens that file and checks its header,
length and payload checksum, so a file that is gone is a miss and a corrupt one a corrupt
miss (the file removed), exactly as without a saved index. Until the check ends, capacity
may count files that are gone (evicting earlier than needed) and miss files the saved index
does not name (a crash after the save: found by the check).

Races with the tier's own work, each decided under the tier's lock: a key being written
(``is_writing``) or already indexed is never added from a header read; a key committed by a
write since the open is never dropped; a lost directory (its generation changed) ends the
check. :meth:`stop` ends it early (the tier's close), and the next open checks again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.storage.disk import files
from kvtier.storage.disk.budget import Evicted
from kvtier.storage.disk.index import DiskEntry, DiskIndex

log = logging.getLogger(__name__)


class CheckHost(Protocol):
    """The disk tier as the check sees it (:class:`~kvtier.storage.disk.tier.DiskTier`)."""

    fingerprint: Fingerprint
    fp_hex: str

    @property
    def index_lock(self) -> threading.Lock: ...

    @property
    def index(self) -> DiskIndex: ...

    def is_writing(self, key: ChunkKey) -> bool: ...

    def directory(self) -> tuple[int, int]: ...  # (generation, fd), under the lock

    def add_released(self, found: Sequence[files.OtherFile]) -> None: ...  # under the lock

    def evict_to_fit(self) -> Evicted: ...  # under the lock; the files unlinked

    def checked(self, temp_removed: int, bad_removed: int, gone: int) -> None: ...

    def report_added(self, keys: Sequence[ChunkKey]) -> None: ...  # under the lock

    def report_removed(self, keys: Sequence[ChunkKey]) -> None: ...


class SavedIndexCheck:
    """See the module docstring. ``trusted``: the keys the open took from the saved index;
    the tier discards a key from it when a write commits that key (:meth:`written`)."""

    def __init__(self, host: CheckHost, trusted: set[ChunkKey]) -> None:
        self._host = host
        self._trusted = trusted
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvtier-disk-index-check", daemon=True
        )
        self._thread.start()

    def written(self, key: ChunkKey) -> None:
        """A write committed ``key`` (called under the tier's lock): it is not a stale entry."""
        self._trusted.discard(key)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the check has ended (finished, stopped or failed)."""
        return self._done.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Ask the check to end and wait for it; True when it has."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        try:
            self._check()
            with self._host.index_lock:
                self._trusted = set()  # a million keys are not kept for the tier's life
        except OSError as exc:  # the directory unusable: the tier notices on its own
            log.warning("disk index check stopped: %s", exc)
        except Exception:
            log.exception("disk index check failed; the saved index stays trusted")
        finally:
            self._done.set()

    def _check(self) -> None:
        host = self._host
        with host.index_lock:
            generation, dir_fd = host.directory()
        prefix, tmp_prefix = f"{host.fp_hex}-", f".{host.fp_hex}-"
        snapshot_tmp = f".{host.fp_hex}.index."
        seen: set[ChunkKey] = set()
        unknown: list[tuple[str, ChunkKey]] = []
        others: list[files.OtherFile] = []
        temp_removed = bad_removed = 0
        for name in files.names(dir_fd):
            if self._stop.is_set():
                return
            if name.startswith(tmp_prefix) and name.endswith(files.TMP_SUFFIX):
                if not files.temp_of_this_process(name):
                    temp_removed += files.unlink_quietly(dir_fd, name)
                continue
            if name.startswith(snapshot_tmp) and name.endswith(".part"):
                temp_removed += files.unlink_quietly(dir_fd, name)  # saves run after stop()
                continue
            if not (name.startswith(prefix) and name.endswith(files.SUFFIX)):
                other = files.other_file(dir_fd, name, host.fp_hex)
                if other is not None:
                    others.append(other)
                continue
            key = files.key_of(name, prefix)
            if key is None:
                bad_removed += files.unlink_quietly(dir_fd, name)
            elif key in self._trusted:
                seen.add(key)
            else:
                unknown.append((name, key))
        found: list[files.FoundRecord] = []
        for name, key in unknown:
            if self._stop.is_set():
                return
            if self._known(key):
                continue
            record = files.check_file(dir_fd, name, key, host.fingerprint)
            if record is not None:
                found.append(record)
            elif not self._known(key):
                bad_removed += files.unlink_quietly(dir_fd, name)
        found.sort(key=lambda r: r.mtime_ns)
        self._apply(generation, found, seen, others, temp_removed, bad_removed)

    def _known(self, key: ChunkKey) -> bool:
        with self._host.index_lock:
            return key in self._host.index or self._host.is_writing(key)

    def _apply(
        self,
        generation: int,
        found: list[files.FoundRecord],
        seen: set[ChunkKey],
        others: list[files.OtherFile],
        temp_removed: int,
        bad_removed: int,
    ) -> None:
        host = self._host
        with host.index_lock:
            if host.directory()[0] != generation:
                return  # the directory was lost meanwhile: its index is gone anyway
            index = host.index
            added: list[ChunkKey] = []
            for record in found:
                if record.key not in index and not host.is_writing(record.key):
                    index.add(
                        record.key, DiskEntry(record.header.num_tokens, record.header.record_len)
                    )
                    added.append(record.key)
            host.report_added(added)
            gone = [k for k in self._trusted - seen if k in index and not index.is_pinned(k)]
            for key in gone:
                index.pop(key)
            host.report_removed(gone)
            host.add_released(others)
            evicted = host.evict_to_fit()
            host.checked(temp_removed, bad_removed, len(gone))
        evicted.report()
        log.info(
            "disk index check: %d files the saved index did not name added, %d named files "
            "gone, %d temporary and %d bad files removed, %d evicted to fit",
            len(found),
            len(gone),
            temp_removed,
            bad_removed,
            len(evicted),
        )
