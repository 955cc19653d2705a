"""The shm channel's receive buffers as files in /dev/shm that no dead process can leak.

A /dev/shm file outlives the process that made it: a decoder killed with SIGKILL, OOM-killed,
or shut down by vLLM before kvtier's close ran leaves its whole receive buffer (hundreds of
MiB of RAM) behind until the host reboots. The file must keep a name while the decoder lives
(prefillers that connect later open it by name), so the rule is ownership by lock:

* the decoder holds ``flock(LOCK_EX)`` on its segment for as long as it lives; the kernel
  drops that lock when the last descriptor closes, however the process ends;
* a segment is created under a hidden name, locked, sized, and only then renamed to its
  public ``kvtier-pd-*`` name, so no public segment is ever unlocked while its owner lives;
* every new receive buffer first removes the public segments it can lock (their owners are
  gone), and hidden ones it can lock that are older than :data:`HIDDEN_GRACE_S` (a process
  that died between creating and renaming).

A lock, not a process id, decides: pids are reused, and processes in other pid namespaces
that share /dev/shm are invisible to ``kill(pid, 0)``. Senders open a segment without locking
it, so a prefiller's mapping never keeps a dead decoder's segment alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import time
import uuid
from dataclasses import dataclass

from kvtier.errors import TransferError

log = logging.getLogger(__name__)

PREFIX = "kvtier-pd-"
HIDDEN = "." + PREFIX  # a segment being made: locked, not yet under its public name
HIDDEN_GRACE_S = 60.0
POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # pre-fault the mapping: no faults on the hot path


@dataclass
class Segment:
    """A locked segment: ``path`` (its public name), the mapping, and the descriptor that
    holds the lock (closing it is what lets a later sweep remove the file)."""

    path: str
    mapping: mmap.mmap
    lock_fd: int

    def remove(self) -> None:
        """Unlink the name and drop the lock; the mapping goes with its last view."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def create_segment(directory: str, nbytes: int) -> Segment:
    """Sweep ``directory`` of dead processes' segments, then make a locked one of ``nbytes``."""
    sweep_orphans(directory)
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    hidden, public = os.path.join(directory, "." + name), os.path.join(directory, name)
    fd = -1
    try:
        fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | POPULATE)
        os.rename(hidden, public)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(hidden)
        if fd >= 0:
            os.close(fd)
        raise TransferError(
            f"cannot create the shared-memory receive buffer {public} ({nbytes} bytes): {exc}"
        ) from None
    return Segment(public, mapping, fd)


def sweep_orphans(directory: str) -> int:
    """Remove the segments in ``directory`` that no living process holds; returns the bytes
    freed. Only regular files of this user, matched by name, are ever considered."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    freed = removed = 0
    now = time.time()
    for name in names:
        hidden = name.startswith(HIDDEN)
        if not (hidden or name.startswith(PREFIX)):
            continue
        size = _remove_if_orphaned(os.path.join(directory, name), hidden, now)
        if size is not None:
            freed, removed = freed + size, removed + 1
    if removed:
        log.info(
            "removed %d shared-memory receive buffer(s) of %.1f MiB left by processes that "
            "ended without closing them",
            removed,
            freed / 2**20,
        )
    return freed


def _remove_if_orphaned(path: str, hidden: bool, now: float) -> int | None:
    """The file's size if it was an orphan and is now removed, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # gone meanwhile, a link, or not ours to open
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        if hidden and now - info.st_mtime < HIDDEN_GRACE_S:
            return None  # being made right now (the lock comes a moment after the create)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # its owner lives
        # Locked by us: the name still means this file (same inode), and nobody owns it.
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == info.st_ino:
                os.unlink(path)
                return info.st_size
        return None
    finally:
        os.close(fd)
