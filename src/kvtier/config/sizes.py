"""Size parsing: numbers in a key's native unit, or strings with a unit.

LMCache gives CPU and disk sizes as GB floats that it multiplies by 1024**3, and PD buffer
sizes in bytes. kvtier keeps both for numbers, and also takes strings: SI units are
decimal (``"2GB"`` is 2_000_000_000 bytes), IEC units are binary (``"512MiB"`` is
536_870_912 bytes).

So ``max_local_cpu_size: 5`` is 5.00 GiB and ``max_local_cpu_size: "5GB"`` 4.66 GiB: the same
intent, 7 % apart, depending on quotes. Both readings are kept (LMCache configs must mean what
they meant), and :func:`size_notes` says at engine start which one a size got.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

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


# The sizes LMCache gives as GB numbers: where a bare number and a "GB" string differ by 7 %.
GIB_NUMBER_KEYS = ("max_local_cpu_size", "max_local_disk_size")


class SizedConfig(Protocol):
    """What :func:`size_notes` reads of a :class:`~kvtier.config.Config`."""

    @property
    def max_local_cpu_size(self) -> int: ...
    @property
    def local_disk(self) -> str | None: ...
    @property
    def max_local_disk_size(self) -> int: ...
    @property
    def origin(self) -> Mapping[str, str]: ...


def size_notes(config: SizedConfig) -> str:
    """The resolved GB-number sizes in one phrase for the engine's open line, e.g.
    ``max_local_cpu_size 5.00 GiB (default: 5 as a bare number or '5GiB'; '5GB' would be
    4.66 GiB)``; the disk size only where a disk tier is configured."""
    notes = [size_note("max_local_cpu_size", config.max_local_cpu_size, config.origin)]
    if config.local_disk:
        notes.append(size_note("max_local_disk_size", config.max_local_disk_size, config.origin))
    return "; ".join(notes)


def size_note(key: str, nbytes: int, origin: Mapping[str, str]) -> str:
    """``key``'s bytes, where they came from, and the other reading of the same number. The
    bytes alone tell the readings apart: a whole (to 3 decimals) number of GiB came from a bare
    number (or a GiB string), a whole number of GB from a "GB" string."""
    where = origin.get(key, "default")
    in_gib, in_gb = _short(nbytes / GIB), _short(nbytes / 10**9)
    if nbytes and in_gib is not None:
        other = format_size(int(float(in_gib) * 10**9))
        why = f"{in_gib} as a bare number or '{in_gib}GiB'; '{in_gib}GB' would be {other}"
    elif nbytes and in_gb is not None:
        other = format_size(int(float(in_gb) * GIB))
        why = f"'{in_gb}GB' is decimal; a bare {in_gb} would be {other}"
    else:
        return f"{key} {format_size(nbytes)} ({where})"
    return f"{key} {format_size(nbytes)} ({where}: {why})"


def _short(value: float) -> str | None:
    """``value`` written with at most 3 decimals if that is exact (to a byte), else None."""
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text if abs(float(text) - value) * GIB < 1 else None
