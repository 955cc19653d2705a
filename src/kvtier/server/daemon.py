"""``kvtier server``: the long-running process that owns a host's cache.

Lifecycle (systemd- and container-friendly: foreground, logs to stderr, no pid file)::

    open()           listen on the socket (mode 0600); nothing is allocated until a model
                     connects (each model's engine is made by its first Hello)
    serve_forever()  accept connections until stop() (the CLI calls it on SIGTERM/SIGINT);
                     one thread per connection, at most server_max_clients at once
    close()          drain: stop accepting and remove the socket file; let every connection
                     finish the request it is serving, then end it (its leases released);
                     close each engine, which waits for its in-flight disk/Redis writes, so
                     a restarted server finds the disk tier warm

Who may connect: the socket's mode keeps other users out, and a peer whose ``SO_PEERCRED``
uid is not the server's is refused before it can send anything. A connection beyond
``server_max_clients`` gets ``Refused("server full ...")`` and is closed; those being served
are not affected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any, Self

from kvtier.config import Config
from kvtier.errors import KVTierError, StateError
from kvtier.lifecycle import Lifecycle, Opens
from kvtier.p2p.node import P2PNode
from kvtier.server import endpoint
from kvtier.server import protocol as wire
from kvtier.server.admin_ports import MODEL_PORT_SPAN
from kvtier.server.handler import serve_connection
from kvtier.server.models import ModelTable
from kvtier.server.sessions import Session, SessionTable

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2  # how soon serve_forever notices stop()


def admin_plan(config: Config) -> str:
    """Where the admin APIs will be, said at start: each model gets its own when its first
    client connects (its URL is logged then and in ``client.stats()["server"]``)."""
    if not config.internal_api_server_enabled:
        return "admin API off (internal_api_server_enabled: false)"
    host, port = config.internal_api_server_host, config.internal_api_server_port_start
    if not port:
        return (
            f"admin API, dashboard and /metrics per model at http://{host}:<a free port>, "
            "each URL logged when the model's first client connects"
        )
    return (
        f"admin API, dashboard and /metrics per model at http://{host}:{port}+ (each model "
        f"on a port its fingerprint gives, the same after a restart, in {port}.."
        f"{port + MODEL_PORT_SPAN - 1}), each URL logged when the model's first client connects"
    )


class KVTierServer(Opens):
    def __init__(self, config: Config | None = None, socket_path: str | None = None) -> None:
        self.config = config if config is not None else Config.load()
        self.path = endpoint.socket_path(self.config, socket_path)
        self._default_path = endpoint.is_default(self.config, socket_path)
        self.p2p = P2PNode.from_config(self.config)  # p2p_listen: share with peers
        self.models = ModelTable(self.config, self.p2p)
        self.sessions = SessionTable(self.config.server_max_clients)
        self._listener: socket.socket | None = None
        self._threads: dict[int, threading.Thread] = {}
        self._stop = threading.Event()
        self._state = Lifecycle.NEW
        self._lock = threading.Lock()
        self.refused = 0

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Self:
        with self._lock:
            if self._state is Lifecycle.OPEN:
                return self
            if self._state is Lifecycle.CLOSED:
                raise StateError("this KVTierServer is closed; create a new one")
            if self.p2p is not None:
                self.p2p.open()  # refused without p2p_auth_token
            try:
                self.path, self._listener = endpoint.listen(self.path, default=self._default_path)
            except BaseException:
                if self.p2p is not None:
                    self.p2p.close()
                raise
            self._listener.settimeout(_ACCEPT_POLL_S)
            self._state = Lifecycle.OPEN
        log.info(
            "kvtier server listening on unix://%s (pid %d, at most %d clients); %s",
            self.path,
            os.getpid(),
            self.sessions.max_clients,
            admin_plan(self.config),
        )
        return self

    def stop(self) -> None:
        """Ask serve_forever to return (safe from a signal handler)."""
        self._stop.set()

    def serve_forever(self) -> None:
        listener = self._listener
        if listener is None:
            raise StateError("open() the server before serve_forever()")
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.error("accept failed: %s", exc)
                time.sleep(_ACCEPT_POLL_S)
                continue
            self._admit(conn)

    def close(self) -> None:
        """Drain and shut down (see the module docstring). Idempotent."""
        with self._lock:
            if self._state is not Lifecycle.OPEN:
                self._state = Lifecycle.CLOSED
                return
            self._state = Lifecycle.CLOSED
        self._stop.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        endpoint.remove(self.path)
        sessions = self.sessions.all()
        for session in sessions:
            # SHUT_RD: the request being served still gets its reply; the next read sees EOF.
            with contextlib.suppress(OSError):
                session.sock.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + self.config.blocking_timeout_secs
        for thread in list(self._threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        self.models.close()
        if self.p2p is not None:
            self.p2p.close()
        log.info("kvtier server stopped: %d connections drained", len(sessions))

    # -- connections -----------------------------------------------------------------------
    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        pid, uid, _ = endpoint.peer_credentials(conn)
        if uid != os.getuid():
            self._refuse(conn, f"uid {uid} is not the server's owner ({os.getuid()})", pid)
            return
        session = self.sessions.admit(conn, pid, uid)
        if session is None:
            self._refuse(conn, f"server full: {self.sessions.max_clients} clients connected", pid)
            return
        thread = threading.Thread(
            target=self._serve, args=(session,), name=f"kvtier-client-{session.number}"
        )
        thread.daemon = True
        self._threads[session.number] = thread
        thread.start()

    def _serve(self, session: Session) -> None:
        try:
            serve_connection(session, self.models, self.info)
        finally:
            self.sessions.remove(session)
            self._threads.pop(session.number, None)

    def _refuse(self, conn: socket.socket, why: str, pid: int) -> None:
        self.refused += 1
        log.warning("refused a connection from pid %d: %s", pid, why)
        with contextlib.suppress(OSError, KVTierError):
            conn.settimeout(1.0)
            wire.send(conn, wire.Refused(why))
        conn.close()

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "socket": self.path,
            "clients": len(self.sessions),
            "max_clients": self.sessions.max_clients,
            "refused": self.refused,
            "models": len(self.models.slots()),
            **({"p2p": self.p2p.stats()} if self.p2p is not None else {}),
        }
