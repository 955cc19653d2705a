"""kvtier's threads leave the compute cores an engine pinned its thread to, for the CPUs the
engine was given: a thread pinned to one CPU (as vLLM pins its worker's main thread) starts
kvtier threads on the named CPUs and gets its own mask back; with nothing named (any process
but a vLLM worker) every thread keeps the mask it was started with."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.cpu_affinity import engine_cpus, unpin_current_thread, unpinned, use_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="the platform has no CPU masks"
)

ALL = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
ONE = frozenset({min(ALL)}) if ALL else frozenset()


@pytest.fixture
def named() -> Iterator[None]:
    """kvtier's threads named to run on every CPU this test may use; unnamed afterwards."""
    use_cpus(ALL)
    yield
    use_cpus(frozenset())


def in_a_pinned_thread(body: Callable[[dict[str, object]], None]) -> dict[str, object]:
    """Run ``body(seen)`` in a thread pinned to one CPU (what vLLM's OpenMP binding does to
    its worker's main thread); ``seen`` collects what it observed."""
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, ONE)
            body(seen)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return seen


def child_mask(pool: ThreadPoolExecutor | None = None) -> set[int]:
    if pool is not None:
        return pool.submit(os.sched_getaffinity, 0).result()
    out: dict[str, set[int]] = {}
    worker = threading.Thread(target=lambda: out.update(mask=os.sched_getaffinity(0)))
    worker.start()
    worker.join()
    return out["mask"]


@pytest.mark.usefixtures("named")
def test_threads_started_inside_unpinned_run_on_the_named_cpus_and_the_pin_comes_back() -> None:
    def body(seen: dict[str, object]) -> None:
        pinned = os.sched_getaffinity(0)
        with unpinned():
            seen["child"] = child_mask()
        seen["pinned"], seen["after"] = pinned, os.sched_getaffinity(0)

    seen = in_a_pinned_thread(body)
    assert seen["pinned"] == ONE
    assert seen["child"] == ALL
    assert seen["after"] == ONE


@pytest.mark.usefixtures("named")
def test_a_pool_whose_initializer_unpins_runs_on_the_named_cpus_when_its_submitter_is_not() -> None:
    def body(seen: dict[str, object]) -> None:
        with ThreadPoolExecutor(1, initializer=unpin_current_thread) as pool:
            seen["wide"] = child_mask(pool)
        with ThreadPoolExecutor(1) as pool:  # without it: the submitter's one CPU
            seen["narrow"] = child_mask(pool)

    seen = in_a_pinned_thread(body)
    assert seen["wide"] == ALL
    assert seen["narrow"] == ONE


def test_with_no_cpus_named_every_thread_keeps_the_mask_it_started_with() -> None:
    def body(seen: dict[str, object]) -> None:
        with unpinned():
            seen["child"] = child_mask()
        with ThreadPoolExecutor(1, initializer=unpin_current_thread) as pool:
            seen["pool"] = child_mask(pool)

    seen = in_a_pinned_thread(body)
    assert seen["child"] == ONE and seen["pool"] == ONE


def report_engine_cpus(queue: multiprocessing.Queue[frozenset[int]]) -> None:
    queue.put(engine_cpus())


def test_engine_cpus_are_the_mask_of_the_process_that_started_the_worker() -> None:
    """A worker started through multiprocessing (as vLLM's engine core starts its workers)
    reads its parent's mask, whatever its own main thread was pinned to; the process nobody
    started so reads nothing (its parent is a shell)."""
    if multiprocessing.parent_process() is None:  # pytest itself, started from a shell
        assert engine_cpus() == frozenset()
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue[frozenset[int]] = context.Queue()
    worker = context.Process(target=report_engine_cpus, args=(queue,))
    worker.start()
    try:
        assert queue.get(timeout=60) == frozenset(os.sched_getaffinity(0))
    finally:
        worker.join(30)
