"""A peer's P2P address, ``host:port`` (``[v6]:port`` for an IPv6 literal)."""

from __future__ import annotations

from kvtier.errors import ConfigError


def parse_address(key: str, text: str) -> tuple[str, int]:
    """``(host, port)`` of ``text``; :class:`ConfigError` naming ``key`` when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(key, text, "host:port, e.g. 10.0.0.7:7700 (port 0-65535)")
    return host, int(port)
