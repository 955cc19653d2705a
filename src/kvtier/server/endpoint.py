"""Where the kvtier server listens, and who may connect (rules: :mod:`kvtier.local_sockets`).

The socket is a Unix stream socket, file mode 0600 (made under a 0177 umask, so there is no
moment where it is wider), in a directory that only its owner can write: the server creates
it 0700 when missing and refuses one owned by another user (root excepted, for
``/run/kvtier``) or writable by group or others. Default::

    server_socket set       that path (``unix:///run/kvtier/kvtier.sock`` or a plain path)
    $XDG_RUNTIME_DIR set    $XDG_RUNTIME_DIR/kvtier.sock   (per user, tmpfs, systemd's choice)
    otherwise               $TMPDIR (/tmp)/kvtier-<uid>/kvtier.sock

At the path, only a stale socket of this user is replaced; a live server, a regular file, a
directory or another user's socket is refused and left alone.

Both ends check the other's uid with ``SO_PEERCRED``: the server refuses any peer but its own
uid, and the client trusts only a server of its own uid (before it reads the Welcome or maps
the model's memfd), so a process of another user that bound the path first serves nothing.
"""

from __future__ import annotations

import os
import socket
import tempfile

from kvtier import local_sockets
from kvtier.config import Config
from kvtier.errors import ConfigError

peer_credentials = local_sockets.peer_credentials


def socket_path(config: Config | None = None, url: str | None = None) -> str:
    """The socket path named by ``url`` (``unix://...`` or a path), else by the config."""
    raw = url if url is not None else (config.server_socket if config is not None else None)
    if raw is not None:
        path = raw.removeprefix("unix://")
        if not path.startswith("/") or "\0" in path or path.endswith("/"):
            raise ConfigError(
                "server_socket", raw, "an absolute path or unix:///absolute/path URL of a file"
            )
        return path
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvtier.sock")
    return os.path.join(tempfile.gettempdir(), f"kvtier-{os.geteuid()}", "kvtier.sock")


def listen(path: str, backlog: int = 128) -> socket.socket:
    """A listening socket at ``path``, mode 0600, in a private directory (see the module
    docstring). :class:`StateError` when the directory or what is at ``path`` is refused."""
    local_sockets.private_directory(os.path.dirname(path), root_owned_ok=True)
    return local_sockets.bind(path, backlog)


def remove(path: str) -> None:
    local_sockets.remove(path)
