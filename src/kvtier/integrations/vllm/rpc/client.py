"""The scheduler's end of the lookup channel: typed calls with deadlines, reconnecting.

See the package docstring for the protocol and the deadlines.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, TypeVar

from kvtier import local_sockets
from kvtier.errors import InputError, ProtocolError, StateError, TransferError, TransferTimeout
from kvtier.framing import FrameReader
from kvtier.integrations.vllm.rpc.messages import (
    DEFAULT_TIMEOUT_S,
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
    Hit,
    Leak,
    Leaks,
    Lookup,
    Message,
    Problems,
    PullFrom,
    Pulling,
    Refused,
    Reply,
    Request,
    Stats,
    Welcome,
    check_flush_timeout,
    reader,
    send,
    socket_path,
)
from kvtier.request_salt import RequestSalt

R = TypeVar("R", bound=Reply)


class LookupClient:
    """The scheduler's (or a test's) end of one worker's socket. Thread-safe.

    Every method raises :class:`TransferError` (or a subclass) when the worker cannot be
    reached, is not who it should be, misbehaves or does not answer within ``timeout``;
    a worker's refusal of a well-formed call is a :class:`TransferError` naming its reason.
    ``peer_uid``: the uid the worker must run as (default: ours).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int = 0,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        directory: str | None = None,
        peer_uid: int | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.path = socket_path(engine_id, rank, directory)
        self._chosen = directory is not None
        self.timeout = timeout
        self.peer_uid = os.geteuid() if peer_uid is None else peer_uid
        self._sock: socket.socket | None = None
        self._reader: FrameReader[Message] | None = None
        self._lock = threading.Lock()

    # -- typed calls -----------------------------------------------------------------------
    def lookup(
        self,
        request_id: str,
        tokens: list[int],
        cache_salt: RequestSalt | None = None,
        *,
        timeout: float | None = None,
    ) -> Hit:
        """The hit (and how much of it is in the CPU tier), pinned in the worker until
        :meth:`end`: the worker's :class:`Hit`, as its handler made it."""
        try:
            message = Lookup(str(request_id), [int(t) for t in tokens], cache_salt)
        except (TypeError, ValueError) as exc:
            raise InputError(f"lookup of {request_id!r}: tokens must be integers ({exc})") from None
        return _expect(self._call(message, timeout), Hit)

    def pull(self, pull: PullFrom, *, timeout: float | None = None) -> bool:
        """PD decoder: start (or poll) pulling a transfer; True once it has ended."""
        return _expect(self._call(pull, timeout), Pulling).done

    def end(self, request_id: str, *, timeout: float | None = None) -> bool:
        return _expect(self._call(End(request_id), timeout), Ended).ok

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        return _expect(self._call(GetStats(), timeout), Stats).stats

    def leaks(self, *, timeout: float | None = None) -> list[Leak]:
        return _expect(self._call(GetLeaks(), timeout), Leaks).leaks

    def check(self, *, timeout: float | None = None) -> list[str]:
        return _expect(self._call(Check(), timeout), Problems).problems

    def flush(self, flush_timeout: float, *, timeout: float | None = None) -> bool:
        return _expect(self._call(Flush(check_flush_timeout(flush_timeout)), timeout), Ended).ok

    def clear(self, *, timeout: float | None = None) -> dict[str, int]:
        return _expect(self._call(Clear(), timeout), Cleared).dropped

    def close(self) -> None:
        if self._lock.acquire(timeout=self.timeout):
            try:
                self._drop()
            finally:
                self._lock.release()

    # -- the round trip --------------------------------------------------------------------
    def _call(self, request: Request, timeout: float | None) -> Message:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(
                f"kvtier worker at {self.path}: another call held the channel past this "
                f"call's deadline"
            )
        try:
            try:
                self._connect(deadline)
                assert self._sock is not None and self._reader is not None
                send(self._sock, request, deadline)
                reply = self._reader.read(deadline)
                if reply is None:
                    raise TransferError("the worker closed the connection")
            except TransferError as exc:
                self._drop()  # a half-read reply would answer the next call
                if str(self.path) in str(exc):
                    raise
                raise type(exc)(f"kvtier worker at {self.path}: {exc}") from None
            except Exception as exc:  # e.g. a token msgpack cannot encode: still a failed call
                self._drop()
                raise TransferError(f"kvtier worker at {self.path}: {exc!r}") from None
        finally:
            self._lock.release()
        if isinstance(reply, Failed):
            raise TransferError(f"kvtier worker refused {type(request).__name__}: {reply.message}")
        return reply

    def _connect(self, deadline: float) -> None:
        # The worker opens its socket once vLLM registers the KV caches, which can be after
        # the scheduler starts asking: retry "nobody there" until the deadline.
        while self._sock is None:
            if not self._chosen:  # the worker may have stepped around a squatted directory
                self.path = socket_path(self.engine_id, self.rank)
            what = f"the kvtier worker at {self.path}"
            try:
                if os.path.lexists(self.path.parent):
                    local_sockets.private_directory(
                        str(self.path.parent), create=False, closed=True
                    )
                left = deadline - time.monotonic()
                sock = local_sockets.connect(str(self.path), max(left, 0.001), self.peer_uid, what)
            except StateError as exc:  # the directory is not private: trust nothing in it
                if self._chosen:
                    raise TransferError(str(exc)) from None
                self._wait_for_worker(deadline, str(exc))  # ours is not up beside it yet
                continue
            except TransferError as exc:
                if not isinstance(exc.__cause__, FileNotFoundError | ConnectionRefusedError):
                    raise
                self._wait_for_worker(deadline, f"no kvtier worker listening at {self.path}")
                continue
            frames = reader(sock)
            try:
                send(sock, Hello(VERSION, self.engine_id), deadline)
                reply = frames.read(deadline)
                if isinstance(reply, Refused):
                    raise TransferError(f"{what} refused this client: {reply.reason}")
                if not isinstance(reply, Welcome):
                    got = type(reply).__name__ if reply is not None else "EOF"
                    raise ProtocolError(f"{what} answered Hello with {got}")
            except BaseException:
                sock.close()
                raise
            self._sock, self._reader = sock, frames

    def _wait_for_worker(self, deadline: float, why: str) -> None:
        if time.monotonic() >= deadline:
            raise TransferTimeout(why)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._reader = None


def _expect(reply: Message, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply
