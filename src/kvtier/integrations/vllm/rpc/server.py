"""The worker's end of the lookup channel: listen, check each peer, serve its requests.

See the package docstring for the protocol, who may connect and the deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path

from kvtier import local_sockets
from kvtier.errors import KVTierError, ProtocolError, TransferError, TransferTimeout
from kvtier.integrations.vllm.rpc.messages import (
    CHANNEL_DIRECTORY,
    HELLO_TIMEOUT_S,
    MAX_CONNECTIONS,
    STALL_TIMEOUT_S,
    VERSION,
    Check,
    Clear,
    Cleared,
    End,
    Ended,
    Failed,
    Flush,
    GetLeaks,
    GetStats,
    Hello,
    Leaks,
    Lookup,
    LookupHandler,
    Message,
    Problems,
    PullFrom,
    Pulling,
    Refused,
    Reply,
    Stats,
    Welcome,
    check_flush_timeout,
    reader,
    send,
    socket_path,
)
from kvtier.repeated_log import RepeatedLog

log = logging.getLogger(__name__)


class LookupServer:
    """Serves ``handler`` on the worker's socket until :meth:`close`."""

    def __init__(
        self, engine_id: str, rank: int, handler: LookupHandler, *, directory: str | None = None
    ) -> None:
        self.engine_id = engine_id
        self.path = socket_path(engine_id, rank, directory)
        self._chosen = directory is not None
        self._handler = handler
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._complaints = RepeatedLog(log)
        self.refused = 0

    def open(self) -> LookupServer:
        """Listen. :class:`StateError` when the directory is not private to this user, or
        the path holds something that is not a stale socket of ours."""
        if self._chosen:
            local_sockets.private_directory(str(self.path.parent), closed=True)
        else:  # a directory another user took first is stepped around, not fatal
            default = local_sockets.default_directory(CHANNEL_DIRECTORY)
            self.path = Path(local_sockets.claim_directory(default)) / self.path.name
        self._listener = local_sockets.bind(str(self.path), backlog=64)
        self._listener.settimeout(0.2)  # how soon the accept loop notices close()
        threading.Thread(target=self._accept, name="kvtier-lookup-accept", daemon=True).start()
        return self

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        local_sockets.remove(str(self.path))

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._closed.is_set():
                    self._complaints.warning("accept", "kvtier lookup channel: accept failed")
                    time.sleep(0.05)
                continue
            try:
                local_sockets.check_peer(conn, os.geteuid(), "a lookup channel client")
            except KVTierError as exc:
                self._refuse(conn, str(exc))
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, f"{MAX_CONNECTIONS} connections already open")
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kvtier-lookup", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        self._complaints.warning("refused", "kvtier lookup channel: refused a client: %s", why)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        frames = reader(conn)
        try:
            first = frames.read(time.monotonic() + HELLO_TIMEOUT_S)
            if not isinstance(first, Hello):
                raise ProtocolError(f"expected Hello first, got {type(first).__name__}")
            refusal = self._check_hello(first)
            if refusal is not None:
                send(conn, Refused(refusal), time.monotonic() + 1.0)
                raise ProtocolError(refusal)
            send(conn, Welcome(os.getpid()), time.monotonic() + STALL_TIMEOUT_S)
            while not self._closed.is_set():
                message = frames.read()
                if message is None:
                    return
                send(conn, self._answer(message), time.monotonic() + STALL_TIMEOUT_S)
        except (ProtocolError, TransferTimeout) as exc:
            if not self._closed.is_set():
                self._complaints.warning(
                    "protocol", "kvtier lookup channel: closing a connection: %s", exc
                )
        except TransferError:
            pass  # the peer went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check_hello(self, hello: Hello) -> str | None:
        if hello.version != VERSION:
            return f"client speaks lookup channel version {hello.version}, worker {VERSION}"
        if hello.engine_id != self.engine_id:
            return f"this worker serves engine {self.engine_id!r}, not {hello.engine_id!r}"
        return None

    def _answer(self, message: Message) -> Reply:
        try:
            return self._dispatch(message)
        except ProtocolError:
            raise
        except KVTierError as exc:
            return Failed(type(exc).__name__, str(exc))
        except Exception as exc:  # never let one bad call kill the channel
            log.exception("kvtier lookup channel: %s failed", type(message).__name__)
            return Failed(type(exc).__name__, str(exc))

    def _dispatch(self, message: Message) -> Reply:
        handler = self._handler
        match message:
            case Lookup(request_id=rid, tokens=tokens, cache_salt=salt):
                return handler.lookup(rid, tokens, salt)
            case End(request_id=rid):
                return Ended(handler.end(rid))
            case PullFrom():
                return Pulling(handler.pull(message))
            case GetStats():
                return Stats(handler.stats())
            case GetLeaks():
                return Leaks(handler.leaks())
            case Check():
                return Problems(handler.check())
            case Flush(timeout=timeout):
                return Ended(handler.flush(check_flush_timeout(timeout)))
            case Clear():
                return Cleared(handler.clear())
            case Hello():
                raise ProtocolError("a second Hello on one connection")
            case _:
                raise ProtocolError(f"{type(message).__name__} is a reply, not a request")
