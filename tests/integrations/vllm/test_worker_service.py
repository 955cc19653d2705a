"""The worker's registration: the worker that owns the cache serves its admin API, a decoder
worker receives through its service, and a misspelt key in vLLM's extra config is refused."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from kvtier.service import Service
from tests.integrations.vllm.worker_helpers import CHUNK_BYTES, make_worker


def test_the_worker_that_owns_the_cache_serves_its_admin_api() -> None:
    side = make_worker(internal_api_server_enabled=True, internal_api_server_port_start=0)
    try:
        assert side.admin is not None
        url = side.admin.url
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            assert json.loads(reply.read()) == {"status": "ok"}
        with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
            assert b"kvtier_lookups_total" in reply.read()
    finally:
        side.close()
    assert side.admin is None
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)


def test_a_decoder_worker_receives_through_its_service_and_closes_the_receiver_with_it() -> None:
    """The worker opens no PD receiver itself: it opens a Service, which opens the
    receiver after the engine (pd_role receiver) and closes it before, on worker.close()."""
    side = make_worker(enable_pd=True, pd_role="receiver", pd_buffer_size=f"{4 * CHUNK_BYTES}B")
    try:
        assert isinstance(side.service, Service) and side.engine is side.service.local_engine
        assert side.cache is side.service.cache is side.engine
        receiver = side.service.receiver
        assert receiver is not None
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5):
            pass  # it listens
    finally:
        side.close()
    assert side.service.receiver is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", receiver.port), timeout=2).close()


def test_a_misspelt_key_in_vllms_extra_config_is_refused_naming_where_it_came_from() -> None:
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.sides import load_config

    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.*max_local_cpu_size"):
        load_config({"kvtier.max_local_cpu_sise": "2GiB"})
