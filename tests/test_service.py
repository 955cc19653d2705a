"""Service: the engine, its admin API and its PD receiver open in order and close in reverse."""

from __future__ import annotations

import ast
import mmap
import socket
from pathlib import Path

import pytest
import torch

from kvtier import Config, Service
from kvtier.cache import KVCache
from kvtier.errors import StateError
from kvtier.lifecycle import Lifecycle
from tests.conftest import SMALL_LAYOUT, make_kv, small_config


def decoder_config(port: int) -> Config:
    return small_config(
        enable_pd=True,
        pd_role="receiver",
        pd_buffer_size="64KiB",
        pd_peer_host="127.0.0.1",
        pd_peer_alloc_port=port,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_decoder_service_receives_and_serves_then_closes_everything() -> None:
    config = decoder_config(free_port())
    service = Service(config, SMALL_LAYOUT, model_name="m")
    assert service.receiver is None and service.admin is None  # nothing before open
    with service:
        receiver = service.receiver
        assert receiver is not None and service.admin_url is not None
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5):
            pass  # the PD port answers
        assert service.engine.check_invariants() == []
    assert service.state is Lifecycle.CLOSED
    assert service.engine.state.value == "closed"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", receiver.port), timeout=1).close()
    service.close()  # idempotent
    with pytest.raises(StateError):
        service.open()


def test_a_pd_port_in_use_fails_open_and_leaves_nothing_open() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        service = Service(decoder_config(port), SMALL_LAYOUT, model_name="m")
        with pytest.raises(OSError):
            service.open()
        assert service.engine.state.value == "closed"  # opened, then closed again
        assert service.admin is None and service.receiver is None


def test_a_plain_service_is_just_the_engine() -> None:
    with Service(small_config(), SMALL_LAYOUT, model_name="m") as service:
        assert service.admin is None and service.receiver is None
        service.engine.store(list(range(16)), make_kv(16))
        assert service.engine.lookup(list(range(16)), "r").tokens == 16
        service.engine.end_request("r")


def test_a_service_holds_a_cache_that_is_its_local_engine() -> None:
    """In process, the Service's cache (the KVCache surface connectors call) is its engine."""
    tokens, kv = list(range(32)), make_kv(32)
    with Service(small_config(), SMALL_LAYOUT, model_name="m") as service:
        cache = service.cache
        assert cache is service.local_engine is service.engine
        assert isinstance(cache, KVCache) and cache.state is Lifecycle.OPEN
        assert cache.store(tokens, kv) == 2
        assert cache.lookup(tokens, "r").tokens == 32
        assert torch.equal(cache.retrieve(tokens, "r"), kv)
        assert service.engine.stats()["open_requests"] == 1
        assert cache.end_request("r") and not cache.end_request("r")
        with cache.request("s") as rid:
            assert cache.lookup(tokens, rid).tokens == 32
        assert cache.stats()["open_requests"] == 0  # the context manager ended it
        assert cache.flush(5.0) and cache.check_invariants() == []
        assert not hasattr(service, "lookup")  # a Service holds a cache; it is not one
    assert service.engine.state is Lifecycle.CLOSED


def test_a_service_puts_its_pages_in_the_memory_it_is_given() -> None:
    """The kvtier server's per-model table passes shared memory the same way."""
    asked: list[int] = []

    def memory(nbytes: int) -> mmap.mmap:
        asked.append(nbytes)
        return mmap.mmap(-1, nbytes)

    with Service(small_config(cpu_chunks=4), SMALL_LAYOUT, model_name="m", page_memory=memory):
        assert asked == [4 * SMALL_LAYOUT.chunk_bytes(16)]


# -- Service is the only composer ---------------------------------------------------------------
SRC = Path(__file__).resolve().parents[1] / "src"

# Who may open a node's servers by hand, and why. Everyone else opens a Service (or calls
# a Service for a kvtier server, whose cache is a client).
COMPOSERS: dict[str, frozenset[str]] = {
    "kvtier/service.py": frozenset({"AdminServer", "PDReceiver"}),
    # `kvtier demo --dashboard` moves one admin server, on the port the user named, from
    # each engine the demo opens to the next (kvtier.demo opens plain Engines, no Service):
    # a dashboard for a demo, not a node's admin API.
    "kvtier/cli/demo.py": frozenset({"AdminServer"}),
}


def servers_opened_in(tree: ast.AST) -> list[tuple[str, int]]:
    """Calls that build an admin API or a PD receiver: ``AdminServer(...)``,
    ``PDReceiver(...)``, ``PDReceiver.for_engine(...)`` / ``.for_host(...)`` (also through
    a module attribute, ``receiver.PDReceiver(...)``)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("for_engine", "for_host"):
            func = func.value
        name = (
            func.id
            if isinstance(func, ast.Name)
            else func.attr
            if isinstance(func, ast.Attribute)
            else None
        )
        if name in ("AdminServer", "PDReceiver"):
            found.append((name, node.lineno))
    return sorted(found, key=lambda hit: hit[1])


def composers_outside_service(src: Path) -> list[str]:
    wrong: list[str] = []
    for path in sorted(src.joinpath("kvtier").rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        allowed = COMPOSERS.get(relative, frozenset())
        for name, line in servers_opened_in(ast.parse(path.read_text(), filename=str(path))):
            if name not in allowed:
                wrong.append(f"{relative}:{line} opens {name}")
    return wrong


def test_the_finder_sees_every_way_of_opening_a_server() -> None:
    code = (
        "a = AdminServer(e)\n"
        "b = PDReceiver.for_engine(e).open()\n"
        "c = receiver.PDReceiver.for_host(h)\n"
        "d = PDReceiver(buf, fingerprint='f')\n"
        "e = server.AdminServer(e, port=0)\n"
        "f = PDReceiver.wait_outcome  # not a call\n"
    )
    assert [name for name, _ in servers_opened_in(ast.parse(code))] == [
        "AdminServer",
        "PDReceiver",
        "PDReceiver",
        "PDReceiver",
        "AdminServer",
    ]


def test_only_the_service_opens_an_admin_api_or_a_pd_receiver() -> None:
    """A node (a vLLM worker, a server model, pd-demo, bench pd) is a Service: opening an
    AdminServer or a PDReceiver anywhere else is a second composer to keep in step."""
    assert composers_outside_service(SRC) == []
    assert COMPOSERS.keys() <= {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
