"""Value parsers for config keys. Each takes ``(key, raw)`` and returns the typed value or
raises :class:`ConfigError` naming the key, the value and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config.sizes import parse_size
from kvtier.errors import ConfigError

Parser = Callable[[str, object], Any]

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def boolean(key: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(key, raw, "a boolean (true/false)")


def integer(low: int, high: int) -> Parser:
    def parse(key: str, raw: object) -> int:
        allowed = f"an integer from {low} to {high}"
        if isinstance(raw, bool):
            raise ConfigError(key, raw, allowed)
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, str):
            try:
                raw = int(raw.strip())
            except ValueError:
                raise ConfigError(key, raw, allowed) from None
        if not isinstance(raw, int) or not low <= raw <= high:
            raise ConfigError(key, raw, allowed)
        return raw

    return parse


def positive_float(high: float) -> Parser:
    def parse(key: str, raw: object) -> float:
        allowed = f"a finite number above 0 and at most {high:g}"
        if isinstance(raw, bool):
            raise ConfigError(key, raw, allowed)
        try:
            value = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(key, raw, allowed) from None
        if not math.isfinite(value) or not 0 < value <= high:
            raise ConfigError(key, raw, allowed)
        return value

    return parse


def size(number_unit: int, *, optional: bool = False) -> Parser:
    def parse(key: str, raw: object) -> int | None:
        if raw is None and optional:
            return None
        return parse_size(key, raw, number_unit)

    return parse


def choice(options: Sequence[str], *, optional: bool = False, fold_case: bool = True) -> Parser:
    def parse(key: str, raw: object) -> str | None:
        if raw is None and optional:
            return None
        shown = ", ".join(repr(o) for o in options) + (" or null" if optional else "")
        if not isinstance(raw, str):
            raise ConfigError(key, raw, f"one of {shown}")
        for option in options:
            if raw == option or (fold_case and raw.lower() == option.lower()):
                return option
        raise ConfigError(key, raw, f"one of {shown}")

    return parse


def text(*, optional: bool = True, max_len: int = 4096) -> Parser:
    def parse(key: str, raw: object) -> str | None:
        if raw is None and optional:
            return None
        if not isinstance(raw, str) or len(raw) > max_len:
            raise ConfigError(key, raw, f"a string of at most {max_len} characters")
        return raw

    return parse


class Hidden:
    """Stands for a secret's value in an error: its type and length, never its text."""

    def __init__(self, raw: object) -> None:
        size = f", {len(raw)} characters" if isinstance(raw, str) else ""
        self.description = f"<hidden {type(raw).__name__}{size}>"

    def __repr__(self) -> str:
        return self.description


def secret(inner: Parser) -> Parser:
    """``inner``, for a secret: an error names the key but shows :class:`Hidden` instead of
    the value; an empty (or all-blank) value is refused, never read as "no secret" (a
    ``KVTIER_ADMIN_TOKEN=`` left empty by a template must not quietly turn auth off)."""

    def parse(key: str, raw: object) -> Any:
        if isinstance(raw, str) and not raw.strip():
            raise ConfigError(
                key,
                Hidden(raw),
                "a non-empty secret; to run without one, unset the key (and its "
                "KVTIER_ environment variable) instead of setting it empty",
            )
        try:
            return inner(key, raw)
        except ConfigError as exc:
            raise ConfigError(key, Hidden(raw), exc.allowed) from None

    return parse


def ports(key: str, raw: object) -> tuple[int, ...] | None:
    """One TCP port, or a list of them (LMCache lists one port per tensor-parallel rank)."""
    if raw is None:
        return None
    items = raw if isinstance(raw, list | tuple) else [raw]
    port = integer(1, 65535)
    try:
        parsed = tuple(port(key, item) for item in items)
    except ConfigError:
        raise ConfigError(key, raw, "a TCP port (1-65535) or a list of ports") from None
    if not parsed:
        raise ConfigError(key, raw, "a TCP port (1-65535) or a non-empty list of ports")
    return parsed


def addresses(key: str, raw: object) -> tuple[str, ...] | None:
    """``host:port`` addresses: a list, or one string of them separated by commas."""
    if raw is None:
        return None
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple):
        raise ConfigError(key, raw, "a list of host:port addresses (or one comma-separated)")
    parsed = []
    for item in items:
        host, sep, port = str(item).strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(key, raw, f"host:port addresses; {item!r} is not one")
        parsed.append(str(item).strip())
    return tuple(parsed)


def mapping(key: str, raw: object) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(key, raw, "a mapping of string keys to values")
    return dict(raw)


def remote_url(key: str, raw: object) -> str | None:
    """A remote store URL. A Redis-family or ``s3://`` URL is parsed in full here, so
    ``kvtier check-config`` catches a typo (or an s3 prefix no client can address) at load; a
    URL of another scheme is kept as it is and its scheme checked against the tier registry
    (``kvtier.storage.registry``, a layer above) when an engine is built, so a tier registered
    later needs no change here."""
    if raw is None:
        return None
    from kvtier.config.remote_url import REDIS_SCHEMES, parse_remote_url  # the URL grammar
    from kvtier.config.s3_url import parse_s3_url

    scheme = raw.split("://", 1)[0].lower() if isinstance(raw, str) and "://" in raw else None
    if scheme is None or scheme in REDIS_SCHEMES:
        parse_remote_url(raw)  # raises ConfigError naming remote_url and the accepted forms
    elif scheme == "s3":
        parse_s3_url(str(raw))  # the same errors the s3 tier would raise at engine start
    return str(raw)
