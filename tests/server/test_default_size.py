"""A server started with no config sizes each model's CPU tier to the host: a tenth of the
machine's memory (at most the 5 GiB default), logged; a configured size is taken as given."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest

from kvtier.config import Config
from kvtier.server import models
from kvtier.server.daemon import KVTierServer
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT
from tests.server.server_helpers import open_client

CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


@pytest.fixture
def serve(tempdir: str) -> Iterator[object]:
    made: list[tuple[KVTierServer, threading.Thread]] = []

    def start(config: Config) -> KVTierServer:
        server = KVTierServer(config, os.path.join(tempdir, "kvtier.sock")).open()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        made.append((server, thread))
        return server

    yield start
    for server, thread in made:
        server.stop()
        thread.join(10)
        server.close()


def _served_cpu_bytes(server: KVTierServer) -> int:
    with open_client(f"unix://{server.path}") as client:
        assert client.connected, client._link.last_error
        (slot,) = server.models.slots()
        return slot.cpu_bytes


def test_no_config_gives_each_model_a_tenth_of_a_small_hosts_memory(
    serve: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host = 40 * CHUNK_BYTES + 123  # a small host: its tenth is 4 chunks and a bit
    monkeypatch.setattr(models, "machine_memory", lambda: host)
    with caplog.at_level(logging.INFO, logger="kvtier.server.models"):
        server = serve(Config.load(env={}))  # type: ignore[operator]
    assert _served_cpu_bytes(server) == (host // 10) // CHUNK_BYTES * CHUNK_BYTES
    assert f"a tenth of this machine's {host} bytes of memory" in caplog.text


def test_no_config_on_a_large_host_keeps_the_5_gib_ceiling() -> None:
    config = Config.load(env={})
    ceiling = config.max_local_cpu_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "machine_memory", lambda: 100 * ceiling)
        assert models.model_cpu_bytes(config) == ceiling


def test_the_machines_memory_is_what_the_os_reports() -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory = models.machine_memory()
    assert memory is not None and 0 < memory <= total


def test_a_configured_size_is_taken_as_given_even_the_default_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(models, "machine_memory", lambda: 40 * CHUNK_BYTES)
    for value in ("5GiB", f"{8 * CHUNK_BYTES}B"):
        config = Config.load(overrides={"max_local_cpu_size": value}, env={})
        assert models.model_cpu_bytes(config) == config.max_local_cpu_size
