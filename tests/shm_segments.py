"""vLLM's shared-memory segments that outlive the vLLM that made them.

vLLM's multiprocess executor talks to its workers through a ring buffer in POSIX shared
memory (``vllm/distributed/device_communicators/shm_broadcast.py``: ``MessageQueue``, a
``multiprocessing.shared_memory`` segment named ``psm_*``, 160 MiB with its defaults). Only
the creator's ``__del__`` unlinks it, and a vLLM stopped by a signal (SIGINT, as docs/vllm.md
stops it; SIGTERM; a kill) exits without running it: each such stop leaves 160 MiB in
``/dev/shm``, held by nobody. On a host with a container's 64 MiB ``/dev/shm`` the next vLLM
then cannot start.

The suite snapshots ``/dev/shm`` when it starts and, when it ends, removes the ``psm_*``
segments that appeared meanwhile and that no process has open or mapped: it leaves
``/dev/shm`` as it found it, and says what it removed.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "psm_"


def names() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def in_use() -> set[str]:
    """The names under /dev/shm that some process has open or mapped now."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        base = Path("/proc") / pid
        try:
            for fd in (base / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target.removeprefix("/dev/shm/").split(" ")[0])
            for line in (base / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split(" ")[0])
        except OSError:
            continue  # the process ended, or is not ours to read
    return used


def orphaned(before: set[str]) -> list[Path]:
    """vLLM's segments made since ``before`` that nothing holds any more."""
    held = in_use()
    return [SHM / n for n in sorted(names() - before) if n.startswith(PREFIX) and n not in held]


def sweep(before: set[str]) -> tuple[int, int]:
    """Remove :func:`orphaned` segments; returns how many, and their bytes."""
    count = size = 0
    for path in orphaned(before):
        try:
            size += path.stat().st_size
            path.unlink()
            count += 1
        except OSError:
            continue  # gone meanwhile
    return count, size
