"""``kvtier check-config``'s probe of ``p2p_peers``: each peer dialed with this config's
``p2p_auth_token``, the handshake only (issue 58, item 2).

The handshake (:mod:`kvtier.trust.handshake`, protocol ``p2p``) proves the token both ways,
so a peer that answers and then refuses, or whose proof fails, has another token; one that
does not answer is down or unreachable. Nothing follows the handshake: the peer sees a
connection that closes before its first P2P frame, which it takes as routine.

A peer that is this server itself (``p2p_peers`` is one list for the whole fleet, and the
node skips its own address) is not dialed: before the server starts, nothing listens there.
It is recognised as the node does, by ``p2p_listen``'s address, and also by an address of
this host (one it can bind) on ``p2p_listen``'s port, since the list names hosts as their
peers reach them. All peers are dialed at once; the probe is over within ``timeout`` s.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time

from kvtier.config import Config
from kvtier.errors import AuthError, ConfigError, KVTierError, TransferError, TransferTimeout
from kvtier.p2p.address import parse_address
from kvtier.p2p.protocol import PROTOCOL
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials

_Answers = queue.SimpleQueue[tuple[str, str | None]]


def peers_to_dial(config: Config) -> list[str]:
    """``p2p_peers`` without this server itself."""
    peers = [p.strip() for p in config.p2p_peers or () if p.strip()]
    if config.p2p_listen is None:
        return peers
    listen = config.p2p_listen.strip()
    try:
        _, port = parse_address("p2p_listen", listen)
    except ConfigError:  # reported at load
        return peers
    return [p for p in peers if p != listen and not _is_this_host(p, port)]


def probe_p2p_peers(config: Config, timeout: float) -> list[tuple[str, ConfigError | None]]:
    """(``p2p_peers: handshake with PEER``, its error or None) for each peer, dialed at once."""
    me = Credentials(PROTOCOL, _identity(), config.p2p_auth_token, "p2p_auth_token")
    deadline = time.monotonic() + timeout
    answers: _Answers = queue.SimpleQueue()
    peers: list[str] = []
    found: list[tuple[str, ConfigError | None]] = []
    for peer in peers_to_dial(config):
        try:
            host, port = parse_address("p2p_peers", peer)
        except ConfigError as exc:
            found.append((f"p2p_peers: {peer}", exc))
            continue
        peers.append(peer)
        threading.Thread(
            target=_handshake,
            args=(peer, host, port, me, deadline, answers),
            name=f"kvtier-check-config p2p {peer}",
            daemon=True,
        ).start()
    failures: dict[str, str | None] = {}
    while len(failures) < len(peers):
        try:
            peer, failure = answers.get(timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        except queue.Empty:
            break
        failures[peer] = failure
    for peer in peers:
        failure = failures.get(peer, f"no answer within {timeout:g} s")
        error = None if failure is None else _refused(peer, failure)
        found.append((f"p2p_peers: handshake with {peer}", error))
    return found


def _handshake(
    peer: str, host: str, port: int, me: Credentials, deadline: float, answers: _Answers
) -> None:
    try:
        sock, _ = connect(host, port, me, deadline, f"P2P peer {peer}")
    except AuthError as exc:
        answers.put((peer, f"the token is refused: {exc}"))
    except TransferTimeout as exc:
        answers.put((peer, f"no answer within the time: {exc}"))
    except TransferError as exc:
        answers.put((peer, f"nothing listens there: {exc}"))
    except KVTierError as exc:  # a ProtocolError: something that is not a kvtier P2P port
        answers.put((peer, f"not a kvtier P2P port: {exc}"))
    except Exception as exc:  # whatever it is, it is this peer's answer: lost, it reads as silence
        answers.put((peer, f"{type(exc).__name__}: {exc}"))
    else:
        sock.close()
        answers.put((peer, None))


def _refused(peer: str, failure: str) -> ConfigError:
    return ConfigError(
        "p2p_peers",
        peer,
        f"a kvtier server's P2P port that accepts this p2p_auth_token: {failure}",
    )


def _identity() -> str:
    """How the probe introduces itself in the peer's log (its handshake binds it)."""
    return f"kvtier-check-config@{socket.gethostname()}/{os.getpid()}"[:200]


def _is_this_host(peer: str, listen_port: int) -> bool:
    """``peer`` is an address of this host on ``listen_port``: its host binds here."""
    try:
        host, port = parse_address("p2p_peers", peer)
    except ConfigError:
        return False
    if port != listen_port:
        return False
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as sock:
            sock.bind((address[0], 0))
            return True
    return False
