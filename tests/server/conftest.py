"""A ``kvtier server`` process per test module (start-up is seconds: torch's import), and a
fresh one for tests that kill or restart it."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT
from tests.server.server_helpers import InProcess, ServerProcess, remove_tempdir, short_tempdir

SPAWN = multiprocessing.get_context("spawn")  # forking after torch is imported can hang
CPU_CHUNKS = 64
CPU_BYTES = CPU_CHUNKS * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


@pytest.fixture
def tempdir() -> Iterator[str]:
    path = short_tempdir()
    yield path
    remove_tempdir(path)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module: tests use their own prompts (seeds), so they don't meet."""
    path = short_tempdir()
    proc = ServerProcess(path, max_local_cpu_size=f"{CPU_BYTES}B").start()
    yield proc
    proc.stop()
    remove_tempdir(path)


@pytest.fixture
def make_server(tempdir: str) -> Iterator[object]:
    """``make_server(**config)``: an in-process server in ``tempdir``, closed at the end."""
    made: list[InProcess] = []

    def make(**overrides: object) -> InProcess:
        made.append(InProcess(tempdir, **overrides))
        return made[-1]

    yield make
    for server in made:
        server.close()
