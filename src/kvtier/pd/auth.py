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

import hashlib
import hmac
import ipaddress
import secrets
import socket

from kvtier.errors import ConfigError

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
