"""The lookup channel: how vLLM's scheduler process reaches the cache in the worker process.

The worker owns the cache (see the package docstring for why); the scheduler needs two things
from it between steps, and they cannot wait for the next step's metadata::

    scheduler (engine-core process)                   worker process
    LookupClient.lookup(rid, tokens, salt) ── Unix socket ──▶ pins the hit in rid's lease
                                           ◀── Hit(tokens, cpu_tokens)
    LookupClient.end(rid)                  ── Unix socket ──▶ ends rid's lease (also while idle)
                                           ◀── Ended(ok)

Tests, the benchmark and operators use the same socket for ``stats``, ``leaks``, ``check``
(``check_invariants``), ``flush`` and ``clear``.

The package: :mod:`.messages` (the wire: messages, framing, where the socket is),
:mod:`.server` (the worker's end), :mod:`.client` (the scheduler's end).

Wire: :mod:`kvtier.framing` frames (magic ``KVL``), typed msgspec messages, never pickle. One
connection, one request at a time, each answered by exactly one reply::

    Hello(version, engine_id)          ->  <- Welcome(pid) | Refused(reason), then closes
    Lookup(request_id, tokens, salt)   ->  <- Hit(tokens, cpu_tokens)
    End(request_id)                    ->  <- Ended(ok)
    PullFrom(transfer, tokens, salt,   ->  <- Pulling(done)  (a PD decoder, xPyD: starts the
             host, port)                        pull, then says whether it has ended)
    GetStats / GetLeaks / Check        ->  <- Stats / Leaks / Problems
    Flush(timeout) / Clear             ->  <- Ended(ok) / Cleared(dropped)
    a request the worker cannot serve  ->  <- Failed(kind, message); the connection stays

Who may talk to whom (see :mod:`kvtier.local_sockets` and docs/security.md): the socket sits in
a directory this user owns and nobody else can write (0700; one made by another user, or
writable by others, is refused), the file is 0600, and both ends check the other's uid with
``SO_PEERCRED``: the worker serves only its own uid, the scheduler trusts only a worker of
its own uid. Same-uid processes are trusted (they can read our memory anyway).

Deadlines: every connect, handshake and call has one (the client's ``timeout``, 5 s for a
lookup by default, or the ``timeout=`` of one call), including the wait for the client's own
lock, so a worker that is paused, dead or wedged makes a call fail in bounded time and an
``end`` is never stuck behind a hung lookup. The worker accepts on one thread and serves
each connection on its own: a peer that connects and stays silent holds one of
:data:`MAX_CONNECTIONS` slots until its Hello deadline, and never delays anyone else's accept.
Every failure reaches the caller as a :class:`~kvtier.errors.TransferError` (its
:class:`~kvtier.errors.TransferTimeout`, :class:`~kvtier.errors.AuthError` or
:class:`~kvtier.errors.ProtocolError`); the scheduler turns it into a miss.
"""

from __future__ import annotations

from kvtier.integrations.vllm.rpc.client import LookupClient
from kvtier.integrations.vllm.rpc.messages import (
    FRAMING,
    HEADER,
    HELLO_TIMEOUT_S,
    MAGIC,
    MAX_CONNECTIONS,
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
    LookupHandler,
    Message,
    Problems,
    PullFrom,
    Pulling,
    Refused,
    Reply,
    Request,
    Stats,
    Welcome,
    reader,
    socket_path,
)
from kvtier.integrations.vllm.rpc.server import LookupServer

__all__ = [
    "FRAMING",
    "HEADER",
    "HELLO_TIMEOUT_S",
    "MAGIC",
    "MAX_CONNECTIONS",
    "VERSION",
    "Check",
    "Clear",
    "Cleared",
    "End",
    "Ended",
    "Failed",
    "Flush",
    "GetLeaks",
    "GetStats",
    "Hello",
    "Hit",
    "Leak",
    "Leaks",
    "Lookup",
    "LookupClient",
    "LookupHandler",
    "LookupServer",
    "Message",
    "Problems",
    "PullFrom",
    "Pulling",
    "Refused",
    "Reply",
    "Request",
    "Stats",
    "Welcome",
    "reader",
    "socket_path",
]
