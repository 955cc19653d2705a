"""How much memory this host gives this process: one reading for the engine's size checks,
the server's default CPU tier and ``check-config``.

The limit is physical memory, or the cgroup v2 ``memory.max`` where that is lower (a
container: allocating past it is an OOM kill, not a slow machine). What is available now is
``/proc/meminfo``'s MemAvailable, at most the limit.
"""

from __future__ import annotations

import os

_CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"
_MEMINFO = "/proc/meminfo"


def machine_memory() -> int | None:
    """Bytes this process may use at most; None when neither reading is possible."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    try:
        with open(_CGROUP_MEMORY_MAX) as f:
            limit = f.read().strip()
    except OSError:
        limit = "max"
    if limit.isdigit():
        total = min(int(limit), total) if total is not None else int(limit)
    return total


def available_memory() -> int | None:
    """Bytes available now (MemAvailable, at most :func:`machine_memory`); None when
    unreadable."""
    available = None
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    total = machine_memory()
    if available is not None and total is not None:
        available = min(available, total)
    return available
