"""Who may talk to a PD receiver: a shared-secret, mutual challenge-response handshake.

The receiver's port writes into the decoder's KV cache: a peer that can speak the protocol
can plant KV under any prefix (chunk keys follow from public facts: model, layout, chunk
size, the prompt) and hold the buffer. So, whenever the receiver listens beyond loopback,
both sides must know ``pd_auth_token`` (``KVTIER_PD_AUTH_TOKEN``), and prove it without
putting it on the wire::

    sender                                        receiver
    Hello(..., nonce=Ns)                  ->
                                          <-  Challenge(Nr, HMAC(token, "receiver" Ns Nr))
    checks the receiver's proof
    Proof(HMAC(token, "sender" Ns Nr))    ->  checks the sender's proof
                                          <-  HelloReply (only now: how to reach the buffer)

``Ns`` and ``Nr`` are 32 random bytes each, fresh per connection, so a recorded proof is
worth nothing on another connection; the role label makes the receiver's proof useless as a
sender's. Proofs are compared with :func:`hmac.compare_digest`. What this does not give:
confidentiality or integrity of the bytes after the handshake (no TLS): across hosts, run
the PD port on a network you trust or inside a tunnel (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import secrets
import socket

from kvtier.errors import AuthError, ConfigError, TransferError
from kvtier.pd.protocol import (
    Challenge,
    ErrorReply,
    Hello,
    Message,
    Proof,
    recv_message,
    send_message,
)

NONCE_BYTES = 32
SENDER = "sender"
RECEIVER = "receiver"
_LABEL = b"kvtier-pd-auth-v1"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, role: str, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """What ``role`` sends to show it knows ``token`` on the connection of these nonces."""
    message = b"\0".join((_LABEL, role.encode(), sender_nonce, receiver_nonce))
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def verify(token: str, role: str, sender_nonce: bytes, receiver_nonce: bytes, given: bytes) -> bool:
    if len(sender_nonce) != NONCE_BYTES or len(receiver_nonce) != NONCE_BYTES:
        return False
    return hmac.compare_digest(proof(token, role, sender_nonce, receiver_nonce), given)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address ('' and 0.0.0.0 are
    every interface; a name that does not resolve is not known to be loopback)."""
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None) if host else []
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(_loopback_address(a) for a in addresses)


def _loopback_address(text: str) -> bool:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def check_listen(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token: anyone who can reach the port could
    write KV the decoder then serves."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            "pd_auth_token",
            None,
            f"a shared secret (or KVTIER_PD_AUTH_TOKEN) when the PD receiver listens on "
            f"{host or 'every interface'!r}, beyond loopback: without one anyone who can reach "
            "the port can write KV into the decoder's cache (see docs/security.md)",
        )


# -- the two halves of the handshake, on a connected socket ---------------------------------
def challenge_sender(conn: socket.socket, hello: Hello, token: str) -> None:
    """The receiver's half, after the sender's Hello: raises :class:`AuthError` (having told
    the sender why) unless the sender proves ``token``."""
    if len(hello.nonce) != NONCE_BYTES:
        _tell_unauthorized(conn, "this PD receiver requires pd_auth_token")
        raise AuthError("the sender sent no challenge (it has no pd_auth_token)")
    nonce = new_nonce()
    send_message(conn, Challenge(nonce, proof(token, RECEIVER, hello.nonce, nonce)))
    answer = recv_message(conn)
    if not isinstance(answer, Proof) or not verify(token, SENDER, hello.nonce, nonce, answer.proof):
        _tell_unauthorized(conn, "authentication failed: pd_auth_token differs")
        raise AuthError("the sender failed authentication (another pd_auth_token?)")


def answer_challenge(
    sock: socket.socket, nonce: bytes, token: str | None, where: str
) -> Message | None:
    """The sender's half, after its Hello carrying ``nonce``: checks the receiver's proof,
    sends its own, and returns the receiver's next message (its HelloReply, normally).
    Raises :class:`AuthError` when either side cannot prove the token, or has none while
    the other has one (``where`` names the receiver in the message)."""
    reply = recv_message(sock)
    _raise_if_refused(reply, where)
    if token is None:
        if isinstance(reply, Challenge):
            raise AuthError(f"{where} requires pd_auth_token (KVTIER_PD_AUTH_TOKEN)")
        return reply
    if not isinstance(reply, Challenge):
        # Mutual: KV goes only to a receiver that knows the token too.
        raise AuthError(f"{where} did not prove it knows pd_auth_token (it has none?)")
    if not verify(token, RECEIVER, nonce, reply.nonce, reply.proof):
        raise AuthError(f"{where} failed authentication: its pd_auth_token differs")
    send_message(sock, Proof(proof(token, SENDER, nonce, reply.nonce)))
    answer = recv_message(sock)
    _raise_if_refused(answer, where)
    return answer


def _raise_if_refused(msg: Message | None, where: str) -> None:
    if isinstance(msg, ErrorReply) and msg.kind == "unauthorized":
        raise AuthError(f"{where} refused this sender: {msg.message}")


def _tell_unauthorized(conn: socket.socket, message: str) -> None:
    # Said so that a misconfigured sender gets a clear error; the connection closes anyway.
    with contextlib.suppress(TransferError):
        send_message(conn, ErrorReply("", "unauthorized", message))
