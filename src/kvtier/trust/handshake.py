"""The one handshake every port between kvtier processes opens with (PD push, PD pull, P2P).

Its own frames (:mod:`kvtier.framing`, magic ``KVH``), each body at most
:data:`MAX_BODY_BYTES`: before a peer has proved itself it is given a header's worth of
memory, and the whole exchange has one deadline, whatever the peer's pace::

    dialer                                         listener
    Hello(protocol, identity, nonce, proves)  ->   the protocol must be this port's; a
                                                   token on both sides, or on neither
                                              <-   Challenge(identity, nonce, proof) | Refused
    checks the listener's proof (a listener's,
    on this protocol, for these nonces and
    identities)
    Proof(proof)                              ->   checks the dialer's proof
      | Refused("your proof failed")
                                              <-   Welcome | Refused(why)

Proofs (:mod:`kvtier.trust.proofs`) bind the protocol, the prover's side of the connection,
both identities and both nonces. Without a token (a PD port on loopback only) the same
messages flow with empty proofs, and a side that has a token refuses a side that has none:
the check is mutual, so KV never goes to, nor comes from, a peer that cannot prove the
token. Each refusal names its cause to the other side (wrong token, missing token, another
protocol), so both ends' logs say what to fix.

After ``Welcome`` the connection carries its protocol's own frames; neither side reads a
byte past the handshake's last frame.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from kvtier.errors import AuthError, ProtocolError, TransferError
from kvtier.framing import Framing, read_message
from kvtier.framing import send as send_frame
from kvtier.trust.peer_text import peer_text
from kvtier.trust.proofs import NONCE_BYTES, Side, Transcript, new_nonce, proof, verify

MAGIC = b"KVH"
VERSION = 1
MAX_BODY_BYTES = 1024  # a Hello: a protocol label, an identity of <= 200 characters, a nonce
MAX_IDENTITY_CHARS = 200

T = TypeVar("T")


class Hello(msgspec.Struct, tag=True):
    protocol: str
    identity: str
    nonce: bytes
    proves: bool  # the dialer has a token and will prove it


class Challenge(msgspec.Struct, tag=True):
    identity: str
    nonce: bytes
    proof: bytes  # empty when the listener has no token


class Proof(msgspec.Struct, tag=True):
    proof: bytes  # empty when the dialer has no token


class Welcome(msgspec.Struct, tag=True):
    pass


class Refused(msgspec.Struct, tag=True):
    cause: str  # "unauthorized" or "protocol"
    why: str


Message = Hello | Challenge | Proof | Welcome | Refused
FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)


@dataclass(frozen=True, slots=True)
class Credentials:
    """What one side brings to a handshake."""

    protocol: str  # "pd-push", "pd-pull", "p2p": a proof is worth nothing on another
    identity: str  # how this side introduces itself (bound into both proofs)
    token: str | None
    secret_name: str  # the config key of the token, for messages ("pd_auth_token")


def dial(sock: socket.socket, me: Credentials, deadline: float, where: str) -> str:
    """The dialer's half on a connected ``sock``, whole by ``deadline`` (monotonic); returns
    the listener's identity. Raises :class:`AuthError` when either side cannot prove the
    token (or has none while the other has one), :class:`ProtocolError` on anything else
    the listener says out of turn, :class:`TransferTimeout` past the deadline. ``where``
    names the listener in messages."""
    nonce = new_nonce()
    _send(sock, Hello(me.protocol, me.identity, nonce, me.token is not None), deadline)
    challenge = _expect(sock, Challenge, deadline, where)
    listener = _identity(challenge.identity, where)
    transcript = Transcript(me.protocol, me.identity, listener, nonce, challenge.nonce)
    if me.token is None:
        if challenge.proof:
            raise AuthError(f"{where} requires {me.secret_name}")
        _send(sock, Proof(b""), deadline)
    else:
        if not verify(me.token, Side.LISTENER, transcript, challenge.proof):
            _refuse(sock, "unauthorized", f"your proof failed: {me.secret_name} differs", deadline)
            raise AuthError(f"{where} failed authentication: its {me.secret_name} differs")
        _send(sock, Proof(proof(me.token, Side.DIALER, transcript)), deadline)
    _expect(sock, Welcome, deadline, where)
    return listener


def accept(sock: socket.socket, me: Credentials, deadline: float) -> str:
    """The listener's half on an accepted ``sock``, whole by ``deadline``; returns the
    dialer's identity, or raises (having told the dialer why: :func:`dial`'s errors)."""
    where = "the dialer"
    hello = _expect(sock, Hello, deadline, where)
    dialer = _identity(hello.identity, where)
    if hello.protocol != me.protocol:
        _refuse(sock, "protocol", f"this port speaks {me.protocol}", deadline)
        raise ProtocolError(
            f"{peer_text(dialer)} dialed for {peer_text(hello.protocol)}; this port speaks "
            f"{me.protocol}"
        )
    if me.token is not None and not hello.proves:
        _refuse(sock, "unauthorized", f"this port requires {me.secret_name}", deadline)
        raise AuthError(f"{peer_text(dialer)} has no {me.secret_name}")
    if me.token is None and hello.proves:
        why = f"this port has no {me.secret_name}; both sides must set the same one"
        _refuse(sock, "unauthorized", why, deadline)
        raise AuthError(f"{peer_text(dialer)} has a {me.secret_name}; this port has none")
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolError(f"a nonce of {len(hello.nonce)} bytes (expected {NONCE_BYTES})")
    nonce = new_nonce()
    transcript = Transcript(me.protocol, dialer, me.identity, hello.nonce, nonce)
    mine = proof(me.token, Side.LISTENER, transcript) if me.token is not None else b""
    _send(sock, Challenge(me.identity, nonce, mine), deadline)
    answer = _expect(sock, Proof, deadline, where)
    if me.token is not None and not verify(me.token, Side.DIALER, transcript, answer.proof):
        _refuse(sock, "unauthorized", f"authentication failed: {me.secret_name} differs", deadline)
        raise AuthError(f"{peer_text(dialer)} failed authentication: its {me.secret_name} differs")
    _send(sock, Welcome(), deadline)
    return dialer


def _identity(identity: str, where: str) -> str:
    if len(identity) > MAX_IDENTITY_CHARS or not identity.isprintable():
        raise ProtocolError(
            f"{where} announced an identity that is not {MAX_IDENTITY_CHARS} printable "
            f"characters or fewer: {peer_text(identity)}"
        )
    return identity


def _send(sock: socket.socket, message: Message, deadline: float) -> None:
    send_frame(sock, FRAMING.encode(message), deadline)


def _expect(sock: socket.socket, kind: type[T], deadline: float, where: str) -> T:
    msg = read_message(sock, FRAMING, deadline)
    if isinstance(msg, kind):
        return msg
    if isinstance(msg, Refused):
        error = AuthError if msg.cause == "unauthorized" else ProtocolError
        raise error(f"{where} refused the handshake: {peer_text(msg.why)}")
    got = "end of stream" if msg is None else type(msg).__name__
    raise ProtocolError(f"{where}: expected {kind.__name__} in the handshake, got {got}")


def _refuse(sock: socket.socket, cause: str, why: str, deadline: float) -> None:
    # Said so that the other side's log names the cause; the connection closes anyway.
    with contextlib.suppress(TransferError):
        _send(sock, Refused(cause, why), deadline)
