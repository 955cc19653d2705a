"""Keys kvtier does not know, from the file, the environment or a caller's overrides: refused
naming the nearest known key (a typo must never leave a default in place), except the
``LMCACHE_*`` variables LMCache reads that are not config keys, which are only warned about.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvtier.config import lmcache
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


def check_unknown(unknown: Mapping[str, str]) -> None:
    """Refuse a key kvtier does not know (key -> its source), naming the nearest known key: a
    typo must not silently give a default (``max_local_cpu_sise: 2GiB`` would leave the CPU
    tier at 5 GiB). LMCache's keys that kvtier maps or ignores on purpose never get here
    (:mod:`~kvtier.config.lmcache` takes them first). An ``LMCACHE_*`` environment variable
    that is near no key is only warned about: LMCache itself reads variables that are not
    config keys (``LMCACHE_TRACK_USAGE``, ``LMCACHE_USE_EXPERIMENTAL``...)."""
    refused = _refused_unknown(unknown)
    if refused:
        key, source, nearest = refused[0]
        others = "".join(f"; also {k!r} ({src})" for k, src, _ in refused[1:])
        raise UnknownKeyError(key, _unknown_message(source, nearest) + others)


def unknown_key_errors(unknown: Mapping[str, str]) -> list[ConfigError]:
    """:func:`check_unknown`'s refusal as one error per key (``Config.diagnose``)."""
    return [
        UnknownKeyError(key, _unknown_message(source, nearest))
        for key, source, nearest in _refused_unknown(unknown)
    ]


def _refused_unknown(unknown: Mapping[str, str]) -> list[tuple[str, str, str | None]]:
    """(key, source, nearest key) of each unknown key refused; the ambient ``LMCACHE_*``
    variables are warned about instead."""
    refused: list[tuple[str, str, str | None]] = []
    ambient: list[str] = []
    for key, source in sorted(unknown.items()):
        nearest = lmcache.nearest_key(key)
        if nearest is None and source.startswith("env LMCACHE_"):
            ambient.append(f"{key} from {source}")
        else:
            refused.append((key, source, nearest))
    if ambient:
        log.warning("ignoring LMCache variables kvtier does not use: %s", ", ".join(ambient))
    return refused


def _unknown_message(source: str, nearest: str | None) -> str:
    hint = f"did you mean {nearest!r}?" if nearest else "no kvtier or LMCache key is near it."
    return (
        f"no such key (from {source}): {hint} kvtier's keys: `kvtier check-config --table`; "
        "LMCache keys kvtier maps or ignores: docs/lmcache.md"
    )


class UnknownKeyError(ConfigError):
    """A key kvtier does not know. Its value is not the problem (and may be a secret), so the
    message names the key alone: ConfigError's "has invalid value '(not shown)'" misled."""

    def __init__(self, key: str, allowed: str) -> None:
        super().__init__(key, None, allowed)
        self.args = (f"config key {key!r}: {allowed}",)
