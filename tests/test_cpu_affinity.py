"""kvtier's threads leave the compute cores an engine pinned its thread to: a thread pinned to
one CPU (as vLLM pins its worker's main thread) starts kvtier threads that may run on every
CPU the process may use, and gets its own mask back."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.cpu_affinity import _parse_cpu_list, unpin_current_thread, unpinned, usable_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="the platform has no CPU masks"
)


def in_a_pinned_thread(body: Callable[[dict[str, object]], None]) -> dict[str, object]:
    """Run ``body(seen)`` in a thread pinned to one usable CPU (what vLLM's OpenMP binding
    does to its worker's main thread); ``seen`` collects what it observed."""
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, {min(usable_cpus())})
            body(seen)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return seen


def test_the_kernel_cpu_list_format_is_parsed() -> None:
    assert _parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_cpu_list("5") == {5}
    assert _parse_cpu_list("") == set()
    assert _parse_cpu_list("0-x") == set()  # unreadable: the caller falls back


def test_usable_cpus_include_every_cpu_this_thread_may_use() -> None:
    assert os.sched_getaffinity(0) <= usable_cpus()


def test_threads_started_inside_unpinned_run_on_every_usable_cpu_and_the_pin_comes_back() -> None:
    def body(seen: dict[str, object]) -> None:
        pinned = os.sched_getaffinity(0)
        with unpinned():
            child: dict[str, set[int]] = {}
            worker = threading.Thread(target=lambda: child.update(mask=os.sched_getaffinity(0)))
            worker.start()
            worker.join()
            seen["child"] = child["mask"]
        seen["pinned"], seen["after"] = pinned, os.sched_getaffinity(0)

    seen = in_a_pinned_thread(body)
    assert seen["pinned"] == {min(usable_cpus())}
    assert seen["child"] == usable_cpus()
    assert seen["after"] == seen["pinned"]


def test_a_pool_whose_initializer_unpins_runs_wide_though_its_submitter_is_pinned() -> None:
    def body(seen: dict[str, object]) -> None:
        with ThreadPoolExecutor(1, initializer=unpin_current_thread) as pool:
            seen["wide"] = pool.submit(os.sched_getaffinity, 0).result()
        with ThreadPoolExecutor(1) as pool:  # without it: the submitter's one CPU
            seen["narrow"] = pool.submit(os.sched_getaffinity, 0).result()

    seen = in_a_pinned_thread(body)
    assert seen["wide"] == usable_cpus()
    assert seen["narrow"] == {min(usable_cpus())}
