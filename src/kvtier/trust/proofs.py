"""What a proof binds: the whole connection it was made on, never a role the other side names.

A proof is an HMAC-SHA256, keyed by the shared secret, over the connection's transcript::

    LABEL | protocol | side of the prover | dialer's identity | listener's identity
          | dialer's nonce | listener's nonce

each field length-prefixed (4 bytes, big-endian), so no two transcripts encode alike. The
side is the prover's place on the TCP connection, ``dialer`` (it called ``connect``) or
``listener`` (it called ``accept``), which each side knows for itself and no peer can
choose. So:

* a listener's proof never passes as a dialer's: a port that answers every dialer's
  challenge (a PD source, a P2P port) is no oracle for dialing another port;
* a proof made for one protocol (``pd-push``, ``pd-pull``, ``p2p``) is worthless on another,
  even where two of them share a secret;
* fresh 32-byte nonces from both ends make a recorded proof worthless on any other
  connection, and a proof reflected back on its own connection fails for its side.

Standard-library primitives only (:mod:`hmac`, :mod:`secrets`, :func:`hmac.compare_digest`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from dataclasses import dataclass

LABEL = b"kvtier-trust-1"
NONCE_BYTES = 32


class Side(enum.Enum):
    DIALER = "dialer"
    LISTENER = "listener"


@dataclass(frozen=True, slots=True)
class Transcript:
    """Everything one connection's handshake said, as both ends saw it."""

    protocol: str
    dialer: str  # the identity each side announced
    listener: str
    dialer_nonce: bytes
    listener_nonce: bytes


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def proof(token: str, side: Side, transcript: Transcript) -> bytes:
    """What ``side`` sends to show it knows ``token`` on the connection of ``transcript``."""
    t = transcript
    fields = (
        LABEL,
        t.protocol.encode(),
        side.value.encode(),
        t.dialer.encode(),
        t.listener.encode(),
        t.dialer_nonce,
        t.listener_nonce,
    )
    return hmac.new(token.encode(), b"".join(map(_field, fields)), hashlib.sha256).digest()


def verify(token: str, side: Side, transcript: Transcript, given: bytes) -> bool:
    """Whether ``given`` is ``side``'s proof of ``token`` on this connection."""
    if len(transcript.dialer_nonce) != NONCE_BYTES or len(transcript.listener_nonce) != NONCE_BYTES:
        return False
    return hmac.compare_digest(proof(token, side, transcript), given)
