"""The disk tier's directory: its file descriptor, noticing that it was deleted, and
re-opening the path once it is usable again.

States (the disk tier holds its lock around every change)::

    open ──(st_nlink == 0, or a write's ENOENT)──▶ lost ──(try_reopen: path usable)──▶ open
                                                    │ ▲
                                                    └─┘ try_reopen at most once a second

A lost directory keeps its descriptor (a reader may still be using it; a descriptor number
closed under a reader could be reused for another file); :meth:`close` closes them all,
unless told a stuck reader may still hold one. ``generation`` counts losses, so a write
that started before one can tell that its file landed in the directory that was lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvtier.errors import ConfigError
from kvtier.storage.disk.options import open_directory

log = logging.getLogger(__name__)

REOPEN_INTERVAL_S = 1.0  # how often a call may try to re-open a lost directory


class ChunkDirectory:
    """See the module docstring. Not thread-safe by itself except :meth:`try_reopen`."""

    def __init__(self, path: str, fp_hex: str) -> None:
        self.path = path
        self.fp_hex = fp_hex
        self.fd = -1
        self.lost = False
        self.generation = 0
        self._old_fds: list[int] = []
        self._next_reopen = 0.0
        self._reopen_lock = threading.Lock()

    def open(self) -> int:
        """Open (creating its last component if missing); ConfigError when unusable."""
        self.fd = open_directory(self.path, self.fp_hex)
        return self.fd

    def deleted(self) -> bool:
        """True when the open directory was removed (a deleted directory has no links)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def mark_lost(self) -> bool:
        """Enter the lost state; False when already lost."""
        if self.lost:
            return False
        self.lost = True
        self.generation += 1
        self._next_reopen = time.monotonic() + REOPEN_INTERVAL_S
        return True

    def try_reopen(self, rebuild: Callable[[int], None], lock: threading.Lock) -> bool:
        """At most once per REOPEN_INTERVAL_S, and one caller at a time: open the path
        again and, under ``lock``, switch to it and ``rebuild(fd)`` (which may raise
        OSError: the directory then stays lost). True when the directory is back."""
        if time.monotonic() < self._next_reopen or not self._reopen_lock.acquire(blocking=False):
            return False
        try:
            self._next_reopen = time.monotonic() + REOPEN_INTERVAL_S
            try:
                fd = open_directory(self.path, self.fp_hex)
            except ConfigError as exc:
                log.debug("disk directory still unusable: %s", exc)
                return False
            with lock:
                old, self.fd = self.fd, fd  # the rebuild unlinks through self.fd
                try:
                    rebuild(fd)
                except OSError as exc:
                    self.fd = old
                    os.close(fd)
                    log.debug("disk directory still unusable: %s", exc)
                    return False
                self._old_fds.append(old)
                self.lost = False
            return True
        finally:
            self._reopen_lock.release()

    def close(self, *, keep_open: bool = False) -> None:
        """Close every descriptor, or (``keep_open``: a stuck reader may hold one) none."""
        if not keep_open:
            for fd in [self.fd, *self._old_fds]:
                if fd >= 0:
                    os.close(fd)
        self.fd = -1
        self._old_fds = []
