"""One ``kvtier server``'s P2P node: its port, what it announces, and whom it follows.

Membership, not a coordinator: every server listens on ``p2p_listen`` and follows each
address in ``p2p_peers`` (itself skipped, so one list serves the whole fleet)::

    server A (node)                                  server B (node)
    CPU tier ── membership ──▶ holdings[fp] ──┐      follower of A ── Subscribe ──┐
                                              └──▶ Holdings(reset) snapshot, then ┘
                                                   every add/remove, heartbeats ──▶ B's Directory
    serves Fetch(fp, id, keys) from CPU  ◀──────── B's P2P tier (a lookup miss on B's own tiers)

What a node announces, and how a follower hears it, is :mod:`kvtier.p2p.announce`. A
follower's stream that ends, fails or stays silent past ``p2p_lease_secs`` (heartbeats come
every third of it) drops that peer from the directory at once, and it is dialed again after a
backoff (1 s, doubling to 30 s while it keeps failing; each distinct failure logged once per
interval, naming its cause): a dead peer costs misses for at most the lease, a peer restarted
empty announces an empty snapshot.

Who may connect: kvtier's handshake (:mod:`kvtier.trust`, protocol ``p2p``) proves
``p2p_auth_token`` both ways; a node without one does not start, on loopback either (the
port serves every model's CPU tier). The port is a :class:`~kvtier.trust.port.TrustedPort`:
at most :data:`MAX_CONNECTIONS` connections, :data:`MAX_PENDING` of them not yet
authenticated, each holding a header's worth of memory until it is. Every wait is bounded as
a whole: the handshake, and each Fetch served, by ``blocking_timeout_secs``; the wait for the
next Fetch by :data:`IDLE_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.config import Config
from kvtier.errors import (
    AuthError,
    ConfigError,
    KVTierError,
    ProtocolError,
    StateError,
    TransferError,
)
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.p2p.address import parse_address
from kvtier.p2p.announce import Announcer
from kvtier.p2p.directory import Directory
from kvtier.p2p.fetch import Fetcher
from kvtier.p2p.serve import FetchServer
from kvtier.p2p.tier import P2PTier
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.base import Tier
from kvtier.trust.dial import Backoff, connect
from kvtier.trust.guard import Connection, ConnectionGuard
from kvtier.trust.handshake import Credentials
from kvtier.trust.loopback import is_loopback
from kvtier.trust.peer_text import peer_text
from kvtier.trust.port import TrustedPort, failure_cause

log = logging.getLogger(__name__)

# Subscriptions (one per following peer) and pulling connections (up to 4 per peer's
# engine): 256 serves a fleet of dozens of servers; a flood of unproven dialers holds 16.
MAX_CONNECTIONS = 256
MAX_PENDING = 16
FOLLOW_LOG_INTERVAL = 60.0  # one line per peer and cause per this many seconds
IDLE_S = 300.0  # a pulling connection idle this long is closed (the puller redials)
SERVED_IDS_KEPT = 65536  # transfer ids remembered as used (single use)


class P2PNode:
    def __init__(
        self,
        listen: str,
        peers: Sequence[str],
        *,
        token: str | None,
        lease_secs: float,
        timeout: float,
    ) -> None:
        self.host, self.port = parse_address("p2p_listen", listen)
        self.peers = [p.strip() for p in peers if p.strip()]
        for peer in self.peers:
            parse_address("p2p_peers", peer)
        self.token = token
        self.lease_secs = lease_secs
        self.timeout = timeout
        self.directory = Directory()
        self.fetcher = Fetcher(listen, token)
        self._stop = threading.Event()
        self.announcer = Announcer(timeout=timeout, lease_secs=lease_secs, stop=self._stop)
        self._served: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # _served and _open_socks
        self._port: TrustedPort | None = None
        self.guard = ConnectionGuard(
            max_connections=MAX_CONNECTIONS,
            handshake_timeout=timeout,
            max_pending=MAX_PENDING,
            limit_key="P2P's MAX_CONNECTIONS",
            logger=log,
        )
        self._follow_log = RepeatedLog(log, FOLLOW_LOG_INTERVAL)
        self._threads: list[threading.Thread] = []
        self._open_socks: set[socket.socket] = set()
        self._id = secrets.token_hex(4)
        self.served_chunks = 0
        self.refused = 0

    @classmethod
    def from_config(cls, config: Config) -> P2PNode | None:
        """The node ``config`` asks for (``p2p_listen`` set), or None."""
        if config.p2p_listen is None:
            return None
        return cls(
            config.p2p_listen,
            config.p2p_peers or (),
            token=config.p2p_auth_token,
            lease_secs=config.p2p_lease_secs,
            timeout=config.blocking_timeout_secs,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """How this node introduces itself: its address and a random id of this process, so
        it knows itself under any address (0.0.0.0, a DNS name) that p2p_peers gives it."""
        return f"{self.address}/{self._id}"

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> P2PNode:
        if self.token is None:
            # Always, loopback too (unlike PD's receiver): the port serves the whole CPU tier
            # of every model, and another local user must not read it or feed the directory.
            where = "every interface" if not is_loopback(self.host) else "loopback"
            raise ConfigError(
                "p2p_auth_token",
                None,
                f"a shared secret of 16+ characters (or KVTIER_P2P_AUTH_TOKEN), the same on "
                f"every peer, for p2p_listen {self.address} ({where}): without one anyone who "
                "can reach the port reads the cache and claims chunks in every directory",
            )
        port = TrustedPort(
            name="P2P port",
            host=self.host,
            port=self.port,
            credentials=self._credentials(),
            guard=self.guard,
            serve=self._serve,
            logger=log,
            on_refused=self._refused,
        )
        try:
            port.open()
        except OSError as exc:
            raise ConfigError(
                "p2p_listen", self.address, f"an address this host can listen on ({exc})"
            ) from None
        self._port = port
        self.port = port.port
        # The name carries the bound port: from here every handshake introduces it so.
        port.credentials = self._credentials()
        self.fetcher.node = self.name
        for peer in self.peers:
            if peer != self.address:
                self._start(lambda p=peer: self._follow(p), f"kvtier-p2p-follow-{peer}")
        log.info(
            "kvtier P2P listening on %s, following %d peers (lease %gs)",
            self.address,
            len([p for p in self.peers if p != self.address]),
            self.lease_secs,
        )
        return self

    def _credentials(self) -> Credentials:
        return Credentials(wire.PROTOCOL, self.name, self.token, "p2p_auth_token")

    def close(self) -> None:
        self._stop.set()
        port, self._port = self._port, None
        if port is not None:
            port.close()  # shuts its connections down: subscriptions and pulls served end
        self.announcer.close()
        with self._lock:
            socks = list(self._open_socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=self.timeout)
        self.fetcher.close()

    # -- the models this server runs ---------------------------------------------------------
    def tier(self, fingerprint: str, layout: KVLayout) -> P2PTier:
        """The lower tier an engine of ``fingerprint`` reads its peers' chunks through."""
        return P2PTier(self.directory, self.fetcher, fingerprint, layout, self.timeout)

    def attach(self, fingerprint: str, cpu: Tier, layout: KVLayout, page_bytes: int) -> None:
        """Announce what ``cpu`` (that engine's CPU tier of ``page_bytes`` pages, before any
        client uses it) holds from now on, and serve pulls from it."""
        self.announcer.attach(fingerprint, cpu, layout, page_bytes)

    def detach(self, fingerprint: str) -> None:
        """The engine closes: its chunks are announced gone."""
        self.announcer.detach(fingerprint)

    # -- serving -----------------------------------------------------------------------------
    def _refused(self, state: Connection, exc: KVTierError) -> None:
        self.refused += 1  # a wrong secret, none, another protocol, or too slow

    def _serve(self, state: Connection, peer: str) -> None:
        """One authenticated peer's connection: a subscription, or its pulls (the port
        closes it when this returns)."""
        sock = state.sock
        where = peer_text(peer)
        server: FetchServer | None = None  # made at the first Fetch (a follower needs none)
        try:
            while not self._stop.is_set():
                self.guard.expect(state, IDLE_S, f"no Fetch within {IDLE_S:g}s")
                msg = wire.recv(sock, None)  # the guard's watchdog bounds the idle wait
                if msg is None:
                    return
                if isinstance(msg, wire.Subscribe):
                    self.guard.expect(state, math.inf, "")  # each message sent has a deadline
                    self.announcer.stream(sock)
                    return
                if not isinstance(msg, wire.Fetch):
                    raise ProtocolError(f"expected Subscribe or Fetch, got {type(msg).__name__}")
                limit = self.timeout
                self.guard.expect(state, limit, f"a Fetch not served within {limit:g}s")
                server = server if server is not None else FetchServer()
                self._serve_fetch(sock, msg, server, time.monotonic() + limit)
        except (KVTierError, OSError) as exc:
            if not self._stop.is_set():
                # A follower or puller that went away (its server stopped) is routine.
                routine = type(exc) is TransferError and not state.overdue
                cause = state.overdue or exc
                log.log(logging.INFO if routine else logging.WARNING, "P2P %s: %s", where, cause)
        finally:
            if server is not None:
                server.close()

    def _serve_fetch(
        self, sock: socket.socket, fetch: wire.Fetch, server: FetchServer, deadline: float
    ) -> None:
        with self._lock:
            used = fetch.transfer_id in self._served
            self._served[fetch.transfer_id] = None
            while len(self._served) > SERVED_IDS_KEPT:
                self._served.popitem(last=False)
        model = self.announcer.model(fetch.fingerprint)
        if used:
            tid = peer_text(fetch.transfer_id)
            raise ProtocolError(f"transfer {tid} was used already (single use)")
        if model is None:
            for i in range(len(fetch.keys)):
                wire.send(sock, wire.Missing(i, "this server runs no such model now"), deadline)
            wire.send(sock, wire.Done(fetch.transfer_id), deadline)
            return
        self.served_chunks += server.serve(sock, fetch.transfer_id, fetch.keys, model, deadline)

    # -- following a peer ------------------------------------------------------------------
    def _follow(self, peer: str) -> None:
        host, port = parse_address("p2p_peers", peer)
        backoff = Backoff()
        where = f"P2P peer {peer}"
        while not self._stop.is_set():
            sock: socket.socket | None = None
            followed = False
            try:
                deadline = time.monotonic() + self.timeout
                sock, name = connect(host, port, self._credentials(), deadline, where)
                with self._lock:
                    self._open_socks.add(sock)
                if self._stop.is_set():
                    return
                if name == self.name:  # p2p_peers names this node by another address
                    log.info("P2P peer %s is this server itself: not followed", peer)
                    return
                wire.send(sock, wire.Subscribe(), time.monotonic() + self.timeout)
                while not self._stop.is_set():
                    msg = wire.recv(sock, time.monotonic() + self.lease_secs)
                    if msg is None:
                        raise TransferError("the peer closed its announcements")
                    if not isinstance(msg, wire.Holdings):
                        raise ProtocolError(f"expected Holdings, got {type(msg).__name__}")
                    if not followed:
                        followed = True
                        backoff.succeeded()
                    if msg.fingerprint:
                        self.directory.apply(
                            peer, msg.fingerprint, msg.added, msg.removed, reset=msg.reset
                        )
            except (KVTierError, OSError) as exc:
                if not self._stop.is_set():
                    self._follow_failed(peer, exc)
            finally:
                dropped = self.directory.drop_peer(peer)
                if dropped:
                    log.info("P2P peer %s dropped: %d chunks no longer claimed", peer, dropped)
                if sock is not None:
                    with self._lock:
                        self._open_socks.discard(sock)
                    sock.close()
            self._stop.wait(backoff.failed())

    def _follow_failed(self, peer: str, exc: Exception) -> None:
        """Logged once per interval per peer and cause, naming the cause (a wrong token
        shows as one line a minute, not one a second)."""
        error = exc if isinstance(exc, TransferError) else TransferError(str(exc))
        cause = failure_cause(error)
        self._follow_log.log(
            logging.WARNING if isinstance(exc, AuthError) else logging.INFO,
            (peer, cause),
            "P2P peer %s: %s (%s; its chunks are misses until it is back)",
            peer,
            exc,
            cause,
        )

    def _start(self, target: Any, name: str) -> None:
        if self._stop.is_set():
            raise StateError("this P2P node is closed")
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "peers": self.directory.peers(),
            "served_chunks": self.served_chunks,
            "refused": self.refused,
            "directory_ignored": dataclasses.asdict(self.directory.ignored),
            **{f"pull_{k}": v for k, v in vars(self.fetcher.counters).items()},
        }
