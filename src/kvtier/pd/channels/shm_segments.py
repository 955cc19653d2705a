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

A sender maps a segment its peer *names* (:func:`open_segment`), so the name is all the peer
decides; everything else is checked on the file the sender opened, before it maps a byte::

    the name     kvtier-pd-<pid>-<12 hex digits>, resolved in the sender's own /dev/shm:
                 no slash, no dot, so no other directory and no other file can be named
    the file     opened O_NOFOLLOW (a link is refused, not followed); a regular file with
                 one link (no hard link to a file that is not a segment); owned by the
                 sender's own uid (a segment of another user is never mapped, so a root
                 prefiller cannot be made to write KV into a file of someone else's
                 choosing); at least as large as the buffer the HelloReply describes
    the mapping  before every chunk, the file is still that large (:meth:`PeerSegment.check`):
                 a segment shrunk under the sender is a TransferError, not a SIGBUS

What this leaves: the file can only be shrunk by its owner (the sender's own uid) or root, and
either can kill the sender anyway; one shrinking it in the microseconds between the check and
the copy still ends the sender with SIGBUS. Writing with ``pwrite`` instead of through the
mapping would close that too, but measured 6.8 GB/s against 26.5 for the mapping (tmpfs
writes to one file serialise on its inode lock, so two threads do not help).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
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
NAME = re.compile(re.escape(PREFIX) + r"[0-9]{1,10}-[0-9a-f]{12}")  # what create_segment makes


@dataclass
class Segment:
    """A locked segment: ``path`` (its public name), the mapping, and the descriptor that
    holds the lock (closing it is what lets a later sweep remove the file)."""

    path: str
    mapping: mmap.mmap
    lock_fd: int

    @property
    def name(self) -> str:
        """What a sender is told: the name alone, which it resolves in its own directory."""
        return os.path.basename(self.path)

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
        # Allocated now, not sparse: a /dev/shm too small for the buffer is this error here,
        # not a SIGBUS in whichever process first touches a page tmpfs cannot supply.
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | POPULATE)
        os.rename(hidden, public)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(hidden)
        if fd >= 0:
            os.close(fd)
        raise TransferError(
            f"cannot create the shared-memory receive buffer {public} ({nbytes} bytes): {exc}"
            + _space_hint(directory, nbytes, exc)
        ) from None
    return Segment(public, mapping, fd)


def _space_hint(directory: str, nbytes: int, exc: OSError) -> str:
    """What to do when ``directory`` (a tmpfs: a container's /dev/shm is 64 MiB by default)
    cannot hold the buffer; empty for other errors."""
    if exc.errno != errno.ENOSPC:
        return ""
    try:
        info = os.statvfs(directory)
        free = f"{info.f_bavail * info.f_frsize} bytes free of {info.f_blocks * info.f_frsize}"
    except OSError:
        free = "its free space unknown"
    return (
        f"; {directory} has {free} and this buffer needs {nbytes}: enlarge it (a container's "
        "--shm-size), lower pd_buffer_size, or use transfer_channel: tcp"
    )


@dataclass
class PeerSegment:
    """A receiver's segment as its sender maps it (:func:`open_segment`): the mapping, and
    the descriptor :meth:`check` reads the file's size through."""

    name: str
    fd: int
    mapping: mmap.mmap
    nbytes: int

    def check(self) -> None:
        """Raise :class:`TransferError` unless the file still holds the whole mapping (a
        write into a page past its end would be a SIGBUS)."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError as exc:
            raise TransferError(f"cannot check the receiver's segment {self.name}: {exc}") from None
        if size < self.nbytes:
            raise TransferError(
                f"the receiver's segment {self.name} shrank to {size} bytes under its "
                f"{self.nbytes}-byte mapping; not writing into it"
            )

    def close(self) -> None:
        """Close the descriptor (idempotent). Not the mapping: views of it may still be in use
        (see ``ShmSender.close``); it goes with its last view."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def open_segment(directory: str, name: str, nbytes: int) -> PeerSegment:
    """Map ``nbytes`` of the segment a receiver named ``name``, found in ``directory`` (the
    sender's own), after the checks in the module docstring; :class:`TransferError` naming
    what failed otherwise. The peer chooses only the name, never a path."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TransferError(
            f"the receiver named no shared-memory segment kvtier makes ({name!r}); a segment "
            f"is named {PREFIX}<pid>-<12 hex digits>, in the sender's own {directory}"
        )
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TransferError(f"cannot open the receiver's segment {path}: {exc}") from None
    try:
        _check_peer_file(path, os.fstat(fd), nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | POPULATE)
    except (OSError, ValueError) as exc:
        os.close(fd)
        raise TransferError(f"cannot map the receiver's segment {path}: {exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return PeerSegment(name, fd, mapping, nbytes)


def _check_peer_file(path: str, info: os.stat_result, nbytes: int) -> None:
    me = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        raise TransferError(f"the receiver's segment {path} is not a regular file")
    if info.st_uid != me:
        raise TransferError(
            f"the receiver's segment {path} is owned by uid {info.st_uid}, not by this "
            f"process's uid {me}: the shm channel needs the prefiller and the decoder to run "
            f"as the same user (another user's file is never mapped); use transfer_channel "
            f"tcp between users"
        )
    if info.st_nlink != 1:
        raise TransferError(
            f"the receiver's segment {path} has {info.st_nlink} links: a segment has one, "
            f"another is a hard link to some other file"
        )
    if info.st_size < nbytes:
        raise TransferError(
            f"the receiver's segment {path} holds {info.st_size} bytes, less than the "
            f"{nbytes}-byte buffer its HelloReply describes"
        )


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
