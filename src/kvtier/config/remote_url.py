"""Parsing ``remote_url``: which Redis (or Valkey) deployment the remote tier talks to.

Accepted forms (LMCache's, plus Valkey aliases)::

    redis://[[user]:password@]host:port[/db]     one server, plain TCP
    rediss://[[user]:password@]host:port[/db]    one server, TLS
    unix:///path/to/redis.sock[?db=N]            one server on a Unix socket
    redis-cluster://host1:port1,host2:port2,...  Redis Cluster (any subset of its masters)
    valkey://, valkeys://, valkey-cluster://     the same as redis://, rediss://, redis-cluster://
    resp://, resps://                            the same as redis://, rediss:// (any server that
                                                 speaks RESP, Redis's protocol)

A bad URL raises :class:`~kvtier.errors.ConfigError` naming ``remote_url``, the value (with
its credentials masked) and the accepted forms. Parsing has no side effects: nothing connects.

Credentials end at the **last** ``@`` of the URL, so a password may hold ``/ @ : # ? %``
unencoded (base64 secrets hold ``/``): everything between ``://`` and that ``@`` is the
userinfo, and it is never shown. Well formed (``user:password``, the user plain), the user
is kept and the password masked; otherwise the whole userinfo is masked. Error details
quote only what comes after the credentials.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from kvtier.errors import ConfigError

ACCEPTED_FORMS = (
    "one of redis://host:port[/db], rediss://host:port[/db], unix:///path/to.sock, "
    "redis-cluster://host1:port1,host2:port2,... (valkey://, valkeys://, valkey-cluster://, "
    "resp://, resps:// are aliases)"
)

_SCHEMES = {
    "redis": ("single", False),
    "valkey": ("single", False),
    "rediss": ("single", True),
    "valkeys": ("single", True),
    "resp": ("single", False),
    "resps": ("single", True),
    "unix": ("unix", False),
    "redis-cluster": ("cluster", False),
    "valkey-cluster": ("cluster", False),
}
REDIS_SCHEMES = tuple(_SCHEMES)  # every scheme this grammar parses (the tier registry's list)
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


@dataclass(frozen=True, slots=True)
class RemoteTarget:
    """Where the remote tier connects. ``kind`` is ``single``, ``unix`` or ``cluster``."""

    kind: str
    nodes: tuple[tuple[str, int], ...] = ()  # (host, port): one for single, >= 1 for cluster
    path: str = ""  # unix socket path
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """A printable form with no password (for logs and errors)."""
        if self.kind == "unix":
            return f"unix://{self.path} db {self.db}"
        nodes = ",".join(f"{h}:{p}" for h, p in self.nodes)
        if self.kind == "cluster":
            return f"redis-cluster://{nodes}"
        return f"{'rediss' if self.tls else 'redis'}://{nodes}/{self.db}"


_PLAIN_USER = re.compile(r"^[A-Za-z0-9._~-]*$")
# What may follow the credentials: hosts, ports, a database, a unix path and its ?db=N.
_PLAIN_LOCATION = re.compile(r"^[A-Za-z0-9._~:,\[\]/-]*(\?[A-Za-z0-9=&]*)?$")


def mask_password(url: str) -> str:
    """``url`` with its userinfo masked: ``user:***@`` when well formed, else ``***@``
    (see the module docstring: the credentials end at the last ``@``). What follows them is
    shown only when it looks like a location: a password that holds ``@`` and was written
    without a host would otherwise show its tail as one."""
    scheme, sep, rest = url.partition("://")
    creds, at, after = rest.rpartition("@")
    if not sep or not at:
        return url
    if not _PLAIN_LOCATION.match(after):
        return f"{scheme}://***"
    user, colon, _ = creds.partition(":")
    shown = f"{user}:***" if colon and _PLAIN_USER.match(user) else "***"
    return f"{scheme}://{shown}@{after}"


def parse_remote_url(url: object) -> RemoteTarget:
    """Parse ``remote_url``; see the module docstring for the forms."""
    if not isinstance(url, str) or "://" not in url:
        raise _bad(url, "not a URL")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise _bad(url, f"unknown scheme {scheme!r}")
    kind, tls = _SCHEMES[scheme]
    if kind == "unix":
        return _parse_unix(url)
    rest = url.split("://", 1)[1]
    username, password, rest = _split_credentials(url, rest)
    netloc, _, path = rest.partition("/")
    if kind == "cluster":
        if path.strip("/"):
            raise _bad(url, "a cluster has only database 0; drop the /path")
        nodes = tuple(_host_port(url, part) for part in netloc.split(","))
        return RemoteTarget("cluster", nodes, username=username, password=password)
    if "," in netloc:
        raise _bad(url, "several hosts need the redis-cluster:// scheme")
    return RemoteTarget(
        "single",
        (_host_port(url, netloc),),
        db=_db_number(url, path.strip("/") or "0"),
        tls=tls,
        username=username,
        password=password,
    )


def _split_credentials(url: str, rest: str) -> tuple[str | None, str | None, str]:
    """``(user, password, what follows them)``; the credentials end at the last ``@``."""
    creds, at, after = rest.rpartition("@")
    if not at:
        return None, None, rest
    user, sep, password = creds.partition(":")
    if not sep:
        raise _bad(url, "credentials must be user:password@ or :password@")
    return unquote(user) or None, unquote(password), after


def _host_port(url: str, text: str) -> tuple[str, int]:
    match = _HOST_PORT.match(text.strip())
    if match is None:
        raise _bad(url, f"{_quoted(text)} is not host:port")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise _bad(url, f"port {port} outside 1..65535")
    return match["host"].strip("[]"), port


def _db_number(url: str, text: str) -> int:
    # isascii: str.isdigit() also accepts digits such as '²' that int() refuses
    if not (text.isascii() and text.isdigit()) or int(text) > 10_000:
        raise _bad(url, f"database {_quoted(text)} is not a number from 0")
    return int(text)


def _parse_unix(url: str) -> RemoteTarget:
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/") or parts.path == "/":
        raise _bad(url, "a unix socket URL needs an absolute path: unix:///path/to.sock")
    query = parse_qs(parts.query)
    db = _db_number(url, query.get("db", ["0"])[0])
    return RemoteTarget("unix", path=unquote(parts.path), db=db)


def _quoted(text: str) -> str:
    """``text`` quoted for an error, unless it may be a piece of a password (see
    :func:`mask_password`)."""
    return repr(text) if _PLAIN_LOCATION.match(text) else "what follows the credentials"


def _bad(url: object, why: str) -> ConfigError:
    shown = mask_password(url) if isinstance(url, str) else url
    return ConfigError("remote_url", shown, f"{why}; use {ACCEPTED_FORMS}")
