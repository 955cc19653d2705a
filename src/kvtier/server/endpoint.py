"""Where the kvtier server listens, and who may connect (rules: :mod:`kvtier.local_sockets`).

The socket is a Unix stream socket, file mode 0600 (made under a 0177 umask, so there is no
moment where it is wider), in a directory that only its owner can write: the server creates
it 0700 when missing (not the directories above it) and refuses one owned by another user
(root excepted, for ``/run/kvtier``) or writable by group or others. Default::

    server_socket set       that path (``unix:///run/kvtier/kvtier.sock`` or a plain path)
    $XDG_RUNTIME_DIR set    $XDG_RUNTIME_DIR/kvtier.sock   (per user, tmpfs, systemd's choice)
    otherwise               $TMPDIR (/tmp)/kvtier-<uid>/kvtier.sock, or, when another user
                            made that directory first, kvtier's own private
                            $TMPDIR/kvtier-<uid>.XXXXXXXX/kvtier.sock, where clients look too

At the path, only a stale socket of this user is replaced; a live server, a regular file, a
directory or another user's socket is refused and left alone.

Both ends check the other's uid with ``SO_PEERCRED``: the server refuses any peer but its own
uid, and the client trusts only a server of its own uid (before it reads the Welcome or maps
the model's memfd), so a process of another user that bound the path first serves nothing.
"""

from __future__ import annotations

import os
import shlex
import socket
import tempfile

from kvtier import local_sockets
from kvtier.config import Config
from kvtier.errors import ConfigError, StateError

peer_credentials = local_sockets.peer_credentials


SOCKET_NAME = "kvtier.sock"


def socket_path(config: Config | None = None, url: str | None = None) -> str:
    """The socket path named by ``url`` (``unix://...`` or a path), else by the config, else
    the default: where a server of this user listens now (see the module docstring)."""
    raw = url if url is not None else (config.server_socket if config is not None else None)
    if raw is not None:
        path = raw.removeprefix("unix://")
        if not path.startswith("/") or "\0" in path or path.endswith("/"):
            raise ConfigError(
                "server_socket", raw, "an absolute path or unix:///absolute/path URL of a file"
            )
        return path
    runtime = _runtime_dir()
    if runtime is not None:
        return os.path.join(runtime, SOCKET_NAME)
    return local_sockets.locate(_tmp_default(), SOCKET_NAME)


def is_default(config: Config | None = None, url: str | None = None) -> bool:
    """Whether nobody chose the path (so the server may move aside and clients look)."""
    return url is None and (config is None or config.server_socket is None)


def listen(path: str, backlog: int = 128, *, default: bool = False) -> tuple[str, socket.socket]:
    """(path, a listening socket there), mode 0600, in a private directory (see the module
    docstring). With ``default``, a squatted ``$TMPDIR/kvtier-<uid>`` is stepped around.
    :class:`StateError` naming the directory, its owner and the setting that moves it when
    the directory or what is at ``path`` is refused."""
    directory = os.path.dirname(path)
    if default and _runtime_dir() is None:
        directory = local_sockets.claim_directory(_tmp_default())
        path = os.path.join(directory, SOCKET_NAME)
    else:
        setting = "XDG_RUNTIME_DIR" if default else "server_socket (or --socket)"
        parent = os.path.dirname(directory.rstrip("/")) or "/"
        # Only the socket's own directory is made (0700): directories above it would get
        # whatever mode the umask gives, so the user makes those, as they want them.
        if not os.path.lexists(directory) and not os.path.lexists(parent):
            raise StateError(
                f"cannot create the socket directory {directory}: its parent {parent} does "
                f"not exist; create it (mkdir -p {shlex.quote(parent)}) or set {setting} to "
                "move the kvtier server's socket"
            )
        try:
            local_sockets.private_directory(directory, root_owned_ok=True)
        except StateError as exc:
            raise StateError(f"{exc}; set {setting} to move the kvtier server's socket") from None
    return path, local_sockets.bind(path, backlog)


def _runtime_dir() -> str | None:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return runtime if runtime and os.path.isdir(runtime) else None


def _tmp_default() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvtier-{os.geteuid()}")


def remove(path: str) -> None:
    local_sockets.remove(path)
