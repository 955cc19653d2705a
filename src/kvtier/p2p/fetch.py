"""The puller's end of a P2P pull: dial a peer, fetch chunks straight into our own pages.

One :meth:`Fetcher.fetch` is one transfer (a fresh single-use id) of one peer's run of a
prompt's chunks. Each chunk's payload is received into the page the engine gave for it
(``out``, no staging copy), a checksum block (1 MiB) at a time, each block hashed as soon as
it landed, while it is still in the cache (:func:`receive_checked`: the check costs no second
pass over memory), and checked against the peer's checksum; a mismatch, a
``Missing``, a dead or silent peer, or the deadline (``blocking_timeout_secs`` from the
start of the engine's read) ends the transfer, and every chunk not yet verified is a miss.
The deadline is for the whole pull, every byte of it: a peer that sends its payload a few
bytes at a time is cut off at the deadline, not at each read's.
The caller's pages stay the caller's: whatever ends the pull, they go back through the
engine's own load path, so a killed peer leaks nothing.

Connections are kept per peer and reused (one transfer at a time each); one that failed is
closed, never reused.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import KVTierError, ProtocolError, TransferError
from kvtier.framing import recv_exact
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.p2p.address import parse_address
from kvtier.pd.checksum import BLOCK_BYTES, BlockHasher
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials
from kvtier.trust.peer_text import peer_text

log = logging.getLogger(__name__)

MAX_IDLE_PER_PEER = 4


@dataclass
class FetchCounters:
    transfers: int = 0
    chunks: int = 0
    bytes: int = 0
    missing: int = 0  # announced, gone by the time it was pulled
    corrupt: int = 0
    failed: int = 0  # transfers cut short by a dead, silent or refusing peer


class Fetcher:
    def __init__(self, node: str, token: str | None) -> None:
        self.node = node
        self.token = token
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.counters = FetchCounters()

    def fetch(
        self,
        peer: str,
        fingerprint: str,
        layout: KVLayout,
        items: Sequence[tuple[ChunkKey, torch.Tensor]],
        deadline: float,
    ) -> list[int | None]:
        """Pull ``items`` (key, page view) from ``peer``; per item its token count, or None
        for a miss. Never raises for the peer's faults: they are misses."""
        results: list[int | None] = [None] * len(items)
        transfer_id = uuid.uuid4().hex
        self.counters.transfers += 1
        sock: socket.socket | None = None
        try:
            sock = self._connection(peer, deadline)
            keys = [key for key, _ in items]
            wire.send(sock, wire.Fetch(fingerprint, transfer_id, keys), deadline)
            while True:
                msg = wire.recv(sock, deadline)
                if msg is None:
                    raise TransferError(f"P2P peer {peer} closed the connection mid-pull")
                if isinstance(msg, wire.Done) and msg.transfer_id == transfer_id:
                    break
                if isinstance(msg, wire.Missing):
                    self.counters.missing += 1
                    log.debug("P2P %s: chunk %d gone: %s", peer, msg.index, peer_text(msg.why))
                    continue
                if not isinstance(msg, wire.Chunk) or not 0 <= msg.index < len(items):
                    raise ProtocolError(f"P2P peer {peer} sent {type(msg).__name__} mid-pull")
                out = items[msg.index][1]
                expected = layout.payload_bytes(msg.num_tokens)
                if msg.nbytes != expected or msg.nbytes > out.numel():
                    raise ProtocolError(
                        f"P2P peer {peer}: chunk of {msg.num_tokens} tokens in {msg.nbytes} "
                        f"bytes (this layout: {expected}, page {out.numel()})"
                    )
                if receive_checked(sock, out[: msg.nbytes], deadline) != msg.checksum:
                    self.counters.corrupt += 1
                    log.warning("P2P %s: chunk %d failed its checksum: a miss", peer, msg.index)
                    continue
                results[msg.index] = msg.num_tokens
                self.counters.chunks += 1
                self.counters.bytes += msg.nbytes
        except (KVTierError, OSError) as exc:
            self.counters.failed += 1
            log.warning("P2P pull %s from %s: %s (the rest are misses)", transfer_id, peer, exc)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            return results
        assert sock is not None
        self._keep(peer, sock)
        return results

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()

    # -- connections -----------------------------------------------------------------------
    def _connection(self, peer: str, deadline: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(peer, [])
            while idle:
                sock = idle.pop()
                if _alive(sock):
                    return sock
                sock.close()
        host, port = parse_address("p2p_peers", peer)
        me = Credentials(wire.PROTOCOL, self.node, self.token, "p2p_auth_token")
        sock, _ = connect(host, port, me, deadline, f"P2P peer {peer}")
        return sock

    def _keep(self, peer: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < MAX_IDLE_PER_PEER:
                idle.append(sock)
                return
        sock.close()


def receive_checked(sock: socket.socket, payload: torch.Tensor, deadline: float) -> int:
    """Receive ``payload``'s bytes straight into it, a checksum block at a time, hashing
    each block as soon as it landed (still in the core's cache: no second pass over memory
    for the check); returns the chunk checksum (:mod:`kvtier.pd.checksum`) of what came.
    ``deadline`` is for the whole payload, every block of it."""
    view = memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
    hasher = BlockHasher()
    for start in range(0, view.nbytes, BLOCK_BYTES):
        block = view[start : start + BLOCK_BYTES]
        recv_exact(sock, block, deadline)
        hasher.update(block)
    return hasher.intdigest()


def _alive(sock: socket.socket) -> bool:
    """An idle connection with something to read was closed by the peer (or is out of step)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable
    except (OSError, ValueError):
        return False
