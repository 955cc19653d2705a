"""Unix sockets that only this user can reach: private directories, peer uids, stale files.

kvtier has two local sockets (the ``kvtier server``'s and each vLLM worker's lookup channel).
Both follow the same rules, written once here:

    directory   owned by this user (or, for an operator's explicit server path, by root),
                never writable by group or others; created 0700 when missing. A directory
                someone else made first, or one that others can write, is refused: another
                user could otherwise bind the path before us and pose as kvtier.
    the path    a live socket there is refused (two servers never share one); a stale socket
                of this user is replaced; anything else (a regular file, a directory, a
                socket of another user) is refused, never deleted.
    the file    mode 0600, bound under a 0177 umask, so it is never wider for a moment.
    both ends   check the peer's uid with ``SO_PEERCRED`` (the kernel's word, not the
                peer's): a server refuses clients of another uid; a client refuses a server
                of another uid before it reads anything from it.

What this does not stop: root, and any process of the same uid (it can read our memory
anyway). See docs/security.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct

from kvtier.errors import AuthError, StateError, TransferError, TransferTimeout

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (for a
    client, the server as it was when it called ``listen``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def check_peer(sock: socket.socket, expected_uid: int, what: str) -> int:
    """The peer's pid, after checking its uid is ``expected_uid``; :class:`AuthError` if not.
    ``what`` names the peer in the message (e.g. "the kvtier server at /run/x.sock")."""
    try:
        pid, uid, _ = peer_credentials(sock)
    except OSError as exc:
        raise AuthError(f"cannot read the credentials of {what}: {exc}") from None
    if uid != expected_uid:
        raise AuthError(
            f"{what} runs as uid {uid} (pid {pid}), not uid {expected_uid}: refusing to trust it"
        )
    return pid


def private_directory(
    path: str, *, create: bool = True, root_owned_ok: bool = False, closed: bool = False
) -> None:
    """Check that only this user can add names to ``path`` (create it 0700 when missing and
    ``create``). Refused with :class:`StateError`: a directory of another user (or of root,
    unless ``root_owned_ok``), a group- or world-writable one (with ``closed``: any access
    for group or others), or something not a directory. ``root_owned_ok`` is for paths an
    operator chose (``/run/kvtier``), never for defaults."""
    me = os.geteuid()
    if create and not os.path.lexists(path):
        parent = os.path.dirname(path.rstrip("/")) or "/"
        if not os.path.isdir(parent):
            raise StateError(f"cannot create {path}: its parent {parent} is not a directory")
        with contextlib.suppress(FileExistsError):  # someone made it meanwhile: checked below
            os.mkdir(path, 0o700)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise StateError(f"socket directory {path} is not usable: {exc}") from None
    if stat.S_ISLNK(info.st_mode):
        info = os.stat(path)  # /var/run -> /run: judge the target, whose owner wrote the link
    if not stat.S_ISDIR(info.st_mode):
        raise StateError(f"socket directory {path} is not a directory")
    owners = (me, 0) if root_owned_ok else (me,)
    if info.st_uid not in owners:
        raise StateError(
            f"socket directory {path} is owned by uid {info.st_uid}, not by this user "
            f"(uid {me}); another user may have created it to pose as kvtier: remove it or "
            f"choose a directory you own"
        )
    if info.st_mode & (0o077 if closed else 0o022):
        raise StateError(
            f"socket directory {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can "
            f"reach or write to it (and bind our socket's name first); use a directory only "
            f"you can use (chmod 700 {path})"
        )


def bind(path: str, backlog: int = 128) -> socket.socket:
    """A listening socket at ``path`` (mode 0600). The directory must already have passed
    :func:`private_directory`. See the module docstring for what may be at ``path``."""
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StateError(f"cannot listen on {path}: {exc}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock


def connect(path: str, timeout: float, expected_uid: int, what: str) -> socket.socket:
    """A connected socket to ``path`` whose listener runs as ``expected_uid``, with
    ``timeout`` set on it. Raises :class:`TransferError` (nobody there: its
    ``FileNotFoundError``/``ConnectionRefusedError`` as ``__cause__``),
    :class:`TransferTimeout` or :class:`AuthError` (a listener of another uid)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except TimeoutError:
            raise TransferTimeout(f"{what} did not accept a connection in {timeout:g} s") from None
        except OSError as exc:
            raise TransferError(f"cannot connect to {what}: {exc}") from exc
        check_peer(sock, expected_uid, what)
    except BaseException:
        sock.close()
        raise
    return sock


def remove(path: str) -> None:
    """Remove our own socket file at ``path`` (on close); anything else is left alone."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
            os.unlink(path)


def _clear_stale(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise StateError(f"cannot listen on {path}: it is a directory; name a socket file in it")
    if not stat.S_ISSOCK(info.st_mode):
        raise StateError(
            f"cannot listen on {path}: a file that is not a socket is there; kvtier only "
            f"replaces a stale socket of its own, never deletes other files"
        )
    if info.st_uid != os.geteuid():
        raise StateError(
            f"cannot listen on {path}: the socket there belongs to uid {info.st_uid}, not this "
            f"user ({os.geteuid()}); it was not left by us, so it is not removed"
        )
    if _answers(path):
        raise StateError(f"something is already listening on {path}")
    os.unlink(path)


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
