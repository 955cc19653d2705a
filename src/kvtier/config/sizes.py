"""Size parsing: numbers in a key's native unit, or strings with a unit.

LMCache gives CPU and disk sizes as GB floats that it multiplies by 1024**3, and PD buffer
sizes in bytes. kvtier keeps both for numbers, and also takes strings: SI units are
decimal (``"2GB"`` is 2_000_000_000 bytes), IEC units are binary (``"512MiB"`` is
536_870_912 bytes).
"""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

GIB = 1024**3
MIB = 1024**2

# Larger than any machine we can address; a value above it is a typo, not a plan.
MAX_SIZE_BYTES = 1024**5

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_ALLOWED = "a number ({unit}) or a string such as '512MiB' or '2GB', between 0 and 1 PiB"


def parse_size(key: str, raw: object, number_unit: int) -> int:
    """Return ``raw`` in bytes. Numbers are multiplied by ``number_unit``."""
    unit_name = "GB, as LMCache reads them" if number_unit == GIB else "bytes"
    allowed = _ALLOWED.format(unit=unit_name)
    if isinstance(raw, bool):
        raise ConfigError(key, raw, allowed)
    if isinstance(raw, int | float):
        value = float(raw) * number_unit
    elif isinstance(raw, str):
        match = _SIZE_RE.match(raw)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(key, raw, allowed)
        number, unit = match.groups()
        multiplier = _UNITS[unit.lower()] if unit else number_unit
        value = float(number) * multiplier
    else:
        raise ConfigError(key, raw, allowed)
    if not value >= 0 or value > MAX_SIZE_BYTES:  # also rejects NaN
        raise ConfigError(key, raw, allowed)
    return int(value)


def format_size(nbytes: int) -> str:
    """Human form with a binary unit, e.g. ``'5.00 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
