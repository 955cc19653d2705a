"""Where the kvtier server listens, and who may connect.

The socket is a Unix stream socket, file mode 0600 (made under a 0177 umask, so there is no
moment where it is wider), in a directory the server creates 0700 when missing. Default::

    server_socket set       that path (``unix:///run/kvtier.sock`` or ``/run/kvtier.sock``)
    $XDG_RUNTIME_DIR set    $XDG_RUNTIME_DIR/kvtier.sock   (per user, tmpfs, systemd's choice)
    otherwise               /tmp/kvtier-<uid>.sock

File mode keeps other users out of the socket; the server also checks every peer's uid with
``SO_PEERCRED`` and refuses any but its own (a socket passed around or a loosened mode still
lets nobody else in).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

from kvtier.config import Config
from kvtier.errors import ConfigError, StateError

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_path(config: Config | None = None, url: str | None = None) -> str:
    """The socket path named by ``url`` (``unix://...`` or a path), else by the config."""
    raw = url if url is not None else (config.server_socket if config is not None else None)
    if raw:
        path = raw.removeprefix("unix://")
        if not path.startswith("/") or "\0" in path:
            raise ConfigError("server_socket", raw, "an absolute path or unix:///absolute/path URL")
        return path
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvtier.sock")
    return f"/tmp/kvtier-{os.getuid()}.sock"


def listen(path: str, backlog: int = 128) -> socket.socket:
    """A listening socket at ``path``, mode 0600. A stale file (no server answers) is
    replaced; a live server there is a :class:`StateError` (two servers never share one)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        if _answers(path):
            raise StateError(f"a kvtier server is already listening on {path}")
        os.unlink(path)
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


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
