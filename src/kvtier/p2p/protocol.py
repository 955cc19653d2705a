"""The P2P wire: framed msgspec messages between two hosts' ``kvtier server``s (never pickle).

Frames are :mod:`kvtier.framing`'s, magic ``KVQ``. Every connection opens with PD's
shared-secret handshake (:func:`kvtier.pd.auth.proof` / :func:`~kvtier.pd.auth.verify`,
the same HMAC over fresh nonces, here keyed by ``p2p_auth_token``), then carries one kind
of traffic::

    dialer (subscriber or puller)              listener (the peer's P2P port)
    Hello(node, nonce)                    ->
                                          <-  Challenge(nonce, proof)     } only with a
    Proof(proof)                          ->                              } p2p_auth_token
                                          <-  Welcome(node) | Refused(why)

    Subscribe()                           ->   what this peer's CPU tiers hold, and every
                                          <-  Holdings(fp, added, removed, reset)  change
                                          <-  Holdings("", [], [], False)  heartbeat, each
                                                  lease/3 s with nothing to say

    Fetch(fp, transfer id, keys)          ->   read each key from that model's CPU tier
                                          <-  Chunk(index, tokens, nbytes, checksum) + bytes
                                          <-  ... Missing(index): gone since announced, the
                                                  rest of the keys are not sent
                                          <-  Done(transfer id)
    Fetch(...)                            ->   the next pull on the same connection

A chunk's ``checksum`` is PD's (:func:`kvtier.pd.checksum.checksum`) over its payload; the
puller receives the payload straight into its own page and checks it there: a mismatch is
a miss. A transfer id is single use: the listener refuses one it has served.
"""

from __future__ import annotations

import contextlib
import socket
from typing import TypeVar

import msgspec

from kvtier.errors import AuthError, ProtocolError, TransferError, TransferTimeout
from kvtier.framing import HEADER, Framing
from kvtier.pd import auth
from kvtier.pd.protocol import recv_exact

MAGIC = b"KVQ"
VERSION = 1
MAX_BODY_BYTES = 4 << 20  # a Holdings of ~200k keys; senders split bigger ones
KEYS_PER_MESSAGE = 65536  # 16-byte keys: ~1.2 MiB of msgpack per Holdings or Fetch

T = TypeVar("T")


class Hello(msgspec.Struct, tag=True):
    node: str  # the dialer's P2P address, for logs
    nonce: bytes = b""  # its challenge; empty without p2p_auth_token


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes
    proof: bytes


class Proof(msgspec.Struct, tag=True):
    proof: bytes


class Welcome(msgspec.Struct, tag=True):
    node: str


class Refused(msgspec.Struct, tag=True):
    why: str


class Subscribe(msgspec.Struct, tag=True):
    pass


class Holdings(msgspec.Struct, tag=True):
    fingerprint: str  # hex; "" for a heartbeat
    added: list[bytes]
    removed: list[bytes]
    reset: bool = False  # forget what this peer said of this fingerprint before


class Fetch(msgspec.Struct, tag=True):
    fingerprint: str
    transfer_id: str
    keys: list[bytes]


class Chunk(msgspec.Struct, tag=True):
    index: int
    num_tokens: int
    nbytes: int  # the payload follows the frame, then nothing else
    checksum: int


class Missing(msgspec.Struct, tag=True):
    index: int
    why: str


class Done(msgspec.Struct, tag=True):
    transfer_id: str


Message = (
    Hello
    | Challenge
    | Proof
    | Welcome
    | Refused
    | Subscribe
    | Holdings
    | Fetch
    | Chunk
    | Missing
    | Done
)

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)


def send(sock: socket.socket, message: Message) -> None:
    try:
        sock.sendall(FRAMING.encode(message))
    except TimeoutError:
        raise TransferTimeout("the P2P peer did not take a message in time") from None
    except OSError as exc:
        raise TransferError(f"P2P connection lost while sending: {exc}") from None


def recv(sock: socket.socket) -> Message | None:
    """The next message, or None when the peer closed the connection between frames. The
    socket's own timeout bounds each wait (a TransferTimeout)."""
    header = bytearray(HEADER.size)
    try:
        first = sock.recv_into(header, HEADER.size)
    except TimeoutError:
        raise TransferTimeout("the P2P peer sent nothing in time") from None
    except OSError as exc:
        raise TransferError(f"P2P connection lost while receiving: {exc}") from None
    if first == 0:
        return None
    if first < HEADER.size:
        recv_exact(sock, memoryview(header)[first:])
    body = bytearray(FRAMING.parse_header(bytes(header)))
    recv_exact(sock, memoryview(body))
    return FRAMING.decode_body(bytes(body))


def expect(sock: socket.socket, kind: type[T], where: str) -> T:
    """The next message, which must be a ``kind``; a Refused is an :class:`AuthError` or
    :class:`TransferError` naming ``where``."""
    msg = recv(sock)
    if isinstance(msg, Refused):
        error = AuthError if "p2p_auth_token" in msg.why else TransferError
        raise error(f"{where} refused: {msg.why}")
    if not isinstance(msg, kind):
        got = "end of stream" if msg is None else type(msg).__name__
        raise ProtocolError(f"{where}: expected {kind.__name__}, got {got}")
    return msg


# -- the handshake: PD's proofs, on this wire -------------------------------------------------
def dial_handshake(sock: socket.socket, node: str, token: str | None, where: str) -> str:
    """The dialer's half; returns the listener's node name. Mutual: KV is only taken from,
    and holdings only believed of, a peer that proves the token too."""
    nonce = auth.new_nonce() if token is not None else b""
    send(sock, Hello(node, nonce))
    if token is None:
        msg = recv(sock)
        if isinstance(msg, Challenge):
            raise AuthError(f"{where} requires p2p_auth_token (KVTIER_P2P_AUTH_TOKEN)")
        if isinstance(msg, Refused):
            raise AuthError(f"{where} refused: {msg.why}")
        if not isinstance(msg, Welcome):
            raise ProtocolError(f"{where}: expected Welcome, got {type(msg).__name__}")
        return msg.node
    challenge = expect(sock, Challenge, where)
    if not auth.verify(token, auth.RECEIVER, nonce, challenge.nonce, challenge.proof):
        raise AuthError(f"{where} failed authentication: its p2p_auth_token differs")
    send(sock, Proof(auth.proof(token, auth.SENDER, nonce, challenge.nonce)))
    return expect(sock, Welcome, where).node


def accept_handshake(sock: socket.socket, node: str, token: str | None) -> str:
    """The listener's half; returns the dialer's node name, or raises :class:`AuthError`
    after telling the dialer why."""
    hello = expect(sock, Hello, "the P2P dialer")
    if token is None:
        if hello.nonce:
            _refuse(sock, "this peer has no p2p_auth_token; the fleet's peers must agree")
            raise AuthError(f"{hello.node} sent a challenge; this peer has no p2p_auth_token")
        send(sock, Welcome(node))
        return hello.node
    if len(hello.nonce) != auth.NONCE_BYTES:
        _refuse(sock, "this peer requires p2p_auth_token")
        raise AuthError(f"{hello.node} has no p2p_auth_token")
    nonce = auth.new_nonce()
    send(sock, Challenge(nonce, auth.proof(token, auth.RECEIVER, hello.nonce, nonce)))
    answer = expect(sock, Proof, "the P2P dialer")
    if not auth.verify(token, auth.SENDER, hello.nonce, nonce, answer.proof):
        _refuse(sock, "authentication failed: p2p_auth_token differs")
        raise AuthError(f"{hello.node} failed authentication (another p2p_auth_token?)")
    send(sock, Welcome(node))
    return hello.node


def _refuse(sock: socket.socket, why: str) -> None:
    # Said so that a misconfigured peer gets a clear error; the connection closes anyway.
    with contextlib.suppress(TransferError):
        send(sock, Refused(why))
