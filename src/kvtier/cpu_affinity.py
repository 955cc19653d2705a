"""kvtier's threads run on any CPU the process may use, not on the cores an inference engine
pinned its compute to.

vLLM's CPU build binds its OpenMP threads, the worker's main thread among them, to the
compute cores (``VLLM_CPU_OMP_THREADS_BIND``) and leaves the rest (``reserved``) to everything
else. Linux gives a new thread its creator's CPU mask, so every thread kvtier starts inside a
vLLM worker would otherwise share the compute cores with the model, and with vLLM's own
spinning loops: a PD transfer thread waited 30 s there for its turn while the reserved core
idled (a decoder then prefills what it could have pulled). So kvtier's I/O threads widen
their mask to every CPU the process may use when they start (:func:`unpin_current_thread`:
the thread target's first line, or a thread pool's ``initializer``), and the threads a worker
starts at set-up inherit a wide mask (:func:`unpinned`).

Where the platform has no CPU masks (or the cgroup refuses), the threads run as they were.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)


def usable_cpus() -> set[int]:
    """Every CPU this process may be scheduled on (its cgroup's, not the calling thread's
    mask, which an inference engine may have narrowed). Empty where the platform has no
    CPU masks."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    text = _read_first(
        "/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
        "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",  # cgroup v1
    )
    cpus = _parse_cpu_list(text) if text else set()
    return cpus or set(range(os.cpu_count() or 1))


def unpin_current_thread() -> None:
    """Let the calling thread run on every usable CPU (see the module's docstring)."""
    cpus = usable_cpus()
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread, on Linux
    except OSError as exc:  # a cpuset that changed under us: keep the mask we have
        log.debug("kvtier thread keeps its CPU mask: %s", exc)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread runs unpinned inside the block (threads it starts there inherit the
    wide mask), then gets its own mask back."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    unpin_current_thread()
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)


def _read_first(*paths: str) -> str:
    for path in paths:
        with contextlib.suppress(OSError), open(path, encoding="ascii") as f:
            return f.read().strip()
    return ""


def _parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpu-list format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            cpus.update(range(int(low), int(high or low) + 1))
        except ValueError:
            return set()
    return cpus
