"""Which listen addresses need a shared secret: every one that is not loopback."""

from __future__ import annotations

import ipaddress
import socket

from kvtier.errors import ConfigError


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


def check_listen(host: str, token: str | None, secret_name: str = "pd_auth_token") -> None:
    """Refuse to listen beyond loopback without a token: anyone who can reach the port could
    write KV the decoder then serves, or read what the port serves."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            secret_name,
            None,
            f"a shared secret (or KVTIER_{secret_name.upper()}) when a kvtier port listens on "
            f"{host or 'every interface'!r}, beyond loopback: without one anyone who can reach "
            "the port can write KV into the cache or read it (see docs/security.md)",
        )
