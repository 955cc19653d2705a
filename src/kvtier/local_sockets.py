"""Unix sockets that only this user can reach: private directories, peer uids, stale files.

kvtier has two local sockets (the ``kvtier server``'s and each vLLM worker's lookup channel).
Both follow the same rules, written once here:

    directory   owned by this user (or, for an operator's explicit server path, by root),
                never writable by group or others; created 0700 when missing. A directory
                someone else made first, or one that others can write, is refused: another
                user could otherwise bind the path before us and pose as kvtier. A link
                is judged by who made it (this user, or root for an operator's path),
                never by where it points: another user chooses that.
    the path    a live socket there is refused (two servers never share one); a stale socket
                of this user is replaced; anything else (a regular file, a directory, a
                socket of another user) is refused, never deleted.
    the file    mode 0600, bound under a 0177 umask, so it is never wider for a moment.
    both ends   check the peer's uid with ``SO_PEERCRED`` (the kernel's word, not the
                peer's): a server refuses clients of another uid; a client refuses a server
                of another uid before it reads anything from it.

Where the directory is by default (:func:`default_directory`), and what happens when another
user took its name first (:func:`claim_directory`, :func:`locate`)::

    $XDG_RUNTIME_DIR set, ours   $XDG_RUNTIME_DIR/<name>   (per user, 0700, made by systemd:
                                                             nobody else can squat in it)
    otherwise                    $TMPDIR/<name>-<uid>
    that name is someone else's  our own 0700 $TMPDIR/<name>-<uid>.XXXXXXXX beside it (reused
                                 when one is there, else made by ``mkdtemp``, which nobody can
                                 pre-empt); the other end finds it by looking for the socket's
                                 name in our own private directories of that pattern

A squatter can so delay nothing: it costs one warning. Where there is no way on (an explicit
path refused, or no directory can be made at all) the error names the directory, its owner and
the setting that moves it.

What this does not stop: root, and any process of the same uid (it can read our memory
anyway). See docs/security.md.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import socket
import stat
import struct
import tempfile

from kvtier.errors import AuthError, StateError, TransferError, TransferTimeout

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MOVE_DEFAULT = "set XDG_RUNTIME_DIR (or TMPDIR) to a directory you own to move it"


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
    owners = (me, 0) if root_owned_ok else (me,)
    info = _directory_info(path, owners)
    if info.st_uid not in owners:
        raise StateError(
            f"socket directory {path} is owned by {owner_name(info.st_uid)}, not by this user "
            f"({owner_name(me)}); another user may have created it to pose as kvtier: remove "
            f"it or choose a directory you own"
        )
    if info.st_mode & (0o077 if closed else 0o022):
        raise StateError(
            f"socket directory {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can "
            f"reach or write to it (and bind our socket's name first); use a directory only "
            f"you can use (chmod 700 {path})"
        )


def _directory_info(path: str, owners: tuple[int, ...]) -> os.stat_result:
    """The status of the directory ``path`` names, read from a descriptor of it.

    A symbolic link is judged by who made it, not by where it points: another user's link
    ``$TMPDIR/kvtier-<uid>`` -> a directory of ours would pass every check of the target, and
    re-pointed later would cut every client off. A link of one of ``owners`` is followed
    (``/var/run`` -> ``/run``, made by root); anything else is opened with ``O_NOFOLLOW``, so
    a link swapped in after the ``lstat`` is refused rather than followed."""
    path = path.rstrip("/") or "/"  # "link/" would make lstat and O_NOFOLLOW follow it
    try:
        link = os.lstat(path)
    except OSError as exc:
        raise StateError(f"socket directory {path} is not usable: {exc}") from None
    follow = stat.S_ISLNK(link.st_mode)
    if follow and link.st_uid not in owners:
        raise StateError(
            f"socket directory {path} is a symbolic link made by {owner_name(link.st_uid)}, "
            f"not by this user ({owner_name(os.geteuid())}); another user may have made it "
            f"to choose where kvtier listens: remove it or choose a directory you own"
        )
    # O_PATH: the mode needs no read permission on the directory to be read (a 0300 one).
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except NotADirectoryError:
        raise StateError(f"socket directory {path} is not a directory") from None
    except OSError as exc:
        raise StateError(f"socket directory {path} is not usable: {exc}") from None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def owner_name(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 1000`` when the user database does not know it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def default_directory(name: str) -> str:
    """``$XDG_RUNTIME_DIR/<name>`` when that is a directory of this user, else
    ``$TMPDIR/<name>-<uid>``. Both ends compute the same path from the same environment."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _is_ours(runtime):
        return os.path.join(runtime, name)
    return os.path.join(tempfile.gettempdir(), f"{name}-{os.geteuid()}")


def claim_directory(default: str) -> str:
    """The directory a listener uses when no one chose one: ``default`` when it is (or can be
    made) private to this user; when someone else holds that name, our own private directory
    beside it (reused, else made by ``mkdtemp``), with one warning. :class:`StateError` naming
    the directory, its owner and the setting that moves it when there is no way on."""
    try:
        private_directory(default, closed=True)
        return default
    except StateError as exc:
        refused = str(exc)
    for own in fallbacks(default):
        log.warning("%s; using kvtier's own %s instead", refused, own)
        return own
    parent = os.path.dirname(default.rstrip("/")) or "/"
    try:
        made = tempfile.mkdtemp(prefix=os.path.basename(default) + ".", dir=parent)
    except OSError as exc:
        raise StateError(
            f"{refused}; and no private directory can be made beside it in {parent} "
            f"({_owner_of(parent)}): {exc}; {MOVE_DEFAULT}"
        ) from None
    log.warning("%s; using kvtier's own %s instead", refused, made)
    return made


def fallbacks(default: str) -> list[str]:
    """Our own private directories made beside ``default`` when its name was taken, oldest
    first. Directories of that pattern that are not ours, or not private, are ignored."""
    found = []
    for path in glob.glob(glob.escape(default) + ".*"):
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if (
                stat.S_ISDIR(info.st_mode)
                and info.st_uid == os.geteuid()
                and not info.st_mode & 0o077
            ):
                found.append((info.st_mtime, path))
    return [path for _, path in sorted(found)]


def locate(default: str, name: str) -> str:
    """Where a listener of this user that defaulted to ``default`` put socket ``name``: in
    ``default`` when a socket is there, else in the first of our :func:`fallbacks` holding
    one, else in ``default`` (where a listener not up yet will most likely appear)."""
    candidates = [default, *fallbacks(default)]
    for directory in candidates:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode) and _private(directory):
                return path
    return os.path.join(default, name)


def _private(directory: str) -> bool:
    try:
        private_directory(directory, create=False, closed=True)
    except StateError:
        return False
    return True


def _is_ours(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def _owner_of(path: str) -> str:
    try:
        return "owned by " + owner_name(os.stat(path).st_uid)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


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
