"""The lookup channel: how vLLM's scheduler process reaches the Engine in the worker process.

The worker owns the Engine (see the package docstring for why); the scheduler needs two
things from it between steps, and they cannot wait for the next step's metadata:

    scheduler (engine-core process)                  worker process
    LookupClient.lookup(rid, tokens) ── Unix socket ──▶ engine.lookup   (pins, in rid's lease)
    LookupClient.end(rid)            ── Unix socket ──▶ engine.end_request (also while idle)

Tests, the benchmark and operators use the same socket for ``stats``, ``leaks``, ``check``
(``check_invariants``), ``flush`` and ``clear``.

Wire: :mod:`multiprocessing.connection` over ``AF_UNIX`` with an auth key, one request and one
reply per call, ``(op, *args)`` -> ``("ok", value)`` or ``("error", message)``. The socket sits
in a directory only this user can open, named after vLLM's ``engine_id`` (unique per vLLM
instance, and the same in every process of one instance); its auth key is derived from it too.

Every call has a deadline: a worker that died or hangs makes a lookup a miss (logged), never
a stuck scheduler. The server answers each connection on its own thread; the handler it is
given serialises access to the Engine itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError, TransferError, TransferTimeout

log = logging.getLogger(__name__)

Handler = Callable[[str, tuple[Any, ...]], Any]


def socket_path(engine_id: str, rank: int = 0) -> Path:
    """Where the worker of tensor-parallel ``rank`` of vLLM instance ``engine_id`` listens."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"kvtier-vllm-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    return root / f"{digest}-r{rank}.sock"


def _authkey(engine_id: str) -> bytes:
    return hashlib.sha256(b"kvtier-vllm:" + engine_id.encode()).digest()


class LookupServer:
    """Serves ``handler(op, args)`` on the worker's socket until :meth:`close`."""

    def __init__(self, engine_id: str, rank: int, handler: Handler) -> None:
        self.path = socket_path(engine_id, rank)
        self._authkey = _authkey(engine_id)
        self._handler = handler
        self._listener: Listener | None = None
        self._closed = threading.Event()
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()

    def open(self) -> LookupServer:
        self.path.unlink(missing_ok=True)  # left by a worker that was killed
        self._listener = Listener(str(self.path), family="AF_UNIX", authkey=self._authkey)
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
            conn.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if not self._closed.is_set():
                    log.warning("kvtier lookup channel: accept failed", exc_info=True)
                    time.sleep(0.05)
                continue
            except Exception:  # a client with the wrong key (AuthenticationError)
                log.warning("kvtier lookup channel: refused a client", exc_info=True)
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kvtier-lookup", daemon=True
            ).start()

    def _serve(self, conn: Connection) -> None:
        try:
            while not self._closed.is_set():
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                op, *args = message
                try:
                    reply: tuple[str, Any] = ("ok", self._handler(str(op), tuple(args)))
                except KVTierError as exc:
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # never let one bad call kill the channel
                    log.exception("kvtier lookup channel: %s failed", op)
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class LookupClient:
    """The scheduler's (or a test's) end of one worker's socket. Thread-safe."""

    def __init__(self, engine_id: str, rank: int = 0, *, timeout: float = 30.0) -> None:
        self.path = socket_path(engine_id, rank)
        self._authkey = _authkey(engine_id)
        self.timeout = timeout
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """Run ``op`` in the worker. Raises :class:`TransferError` (or its
        :class:`TransferTimeout`) when the worker cannot be reached or fails the call."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            conn = self._connect(deadline)
            try:
                conn.send((op, *args))
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TransferTimeout(f"kvtier worker at {self.path} did not answer {op!r}")
                status, value = conn.recv()
            except (OSError, EOFError, TransferTimeout) as exc:
                self._drop()  # a half-read reply would answer the next call
                if isinstance(exc, TransferTimeout):
                    raise
                raise TransferError(
                    f"kvtier worker at {self.path} failed on {op!r}: {exc}"
                ) from exc
        if status != "ok":
            raise TransferError(f"kvtier worker refused {op!r}: {value}")
        return value

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connect(self, deadline: float) -> Connection:
        # The worker opens its socket once vLLM registers the KV caches, which can be after
        # the scheduler starts asking: retry until the deadline.
        while self._conn is None:
            try:
                self._conn = Client(str(self.path), family="AF_UNIX", authkey=self._authkey)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    raise TransferTimeout(
                        f"no kvtier worker listening at {self.path} (is the vLLM worker up?)"
                    ) from exc
                time.sleep(0.05)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
