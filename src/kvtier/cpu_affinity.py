"""kvtier's threads inside an inference engine's worker run on the CPUs the engine was given,
not only on the cores it pinned its compute to.

vLLM's CPU build binds its OpenMP threads, the worker's main thread among them, to its
compute cores (``VLLM_CPU_OMP_THREADS_BIND``) and leaves the rest of what the process was
given (``reserved``: one core per rank with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``) to everything
else. Linux gives a new thread its creator's CPU mask, so every thread kvtier starts inside a
vLLM worker would otherwise share the compute cores with the model, and with vLLM's own
spinning loops: a PD transfer thread waited 30 s there for its turn while the reserved core
idled (a decoder then prefills what it could have pulled).

So the vLLM worker names the CPUs its engine was given (:func:`engine_cpus`: the mask of the
process that started the worker, which vLLM does not narrow; a ``taskset`` or ``numactl`` a
deployment put vLLM under stays in force) with :func:`use_cpus`, and opens kvtier inside
:func:`unpinned`: threads started there inherit that mask, and thread pools started later
widen theirs when their threads start (:func:`unpin_current_thread`, their ``initializer``).
Outside a vLLM worker nothing is named and every thread keeps the mask it was started with.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)

_io_cpus: frozenset[int] = frozenset()  # where kvtier's threads run; empty: where started


def engine_cpus() -> frozenset[int]:
    """The CPUs of the process that started this one through multiprocessing (a vLLM
    worker's engine core, whose mask vLLM leaves as the deployment set it); empty in a
    process nobody started so (a worker inside the user's own process: its parent is the
    shell, whose mask may be wider than the one the user gave the process) or where the
    parent's mask cannot be read."""
    if not hasattr(os, "sched_getaffinity") or multiprocessing.parent_process() is None:
        return frozenset()
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone, or another user's
        return frozenset()


def use_cpus(cpus: frozenset[int]) -> None:
    """From now on kvtier's threads of this process run on ``cpus`` (empty: where started)."""
    global _io_cpus
    _io_cpus = frozenset(cpus)


def unpin_current_thread() -> None:
    """Move the calling thread onto the CPUs :func:`use_cpus` named, if any."""
    if not _io_cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, _io_cpus)  # 0: the calling thread, on Linux
    except OSError as exc:  # a cpuset that changed under us: keep the mask we have
        log.debug("kvtier thread keeps its CPU mask: %s", exc)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread runs on the named CPUs inside the block (threads it starts there
    inherit them), then gets its own mask back."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    unpin_current_thread()
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)
