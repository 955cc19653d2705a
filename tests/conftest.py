"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvtier import Config, Engine, KVLayout, Service
from tests import hosts, shm_segments
from tests.hosts import (  # noqa: F401 (hooks: the one rule for skips under KVTIER_CI and root)
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)
from tests.recall_training import start_recall_training, stop_recall_training
from tests.redis_servers import RedisServer

# Tests that start vLLM (one engine, a fleet, the demo) share module and session vLLM
# fixtures. Under pytest-xdist (`make test` runs two workers) they form two work units, each
# run in order on one worker from the start (the largest units are sent first): the modules
# that share the session's reference outputs of vLLM alone in one, the rest in the other,
# of about equal length. Each worker's vLLMs compute on CPUs of their own (below), so the
# two units do not take turns on one core; every other test is a unit of its own, run by
# whichever worker is free. (A scheduler of our own rather than xdist_group marks: with
# pytest 9, xdist 3.8 cannot rename the nodeids those marks rely on and ignores them.)
VLLM_TESTS = (
    "tests/integrations/vllm/",
    "tests/benchmarks/",
    "tests/demo/test_vllm_demo.py",
    "tests/docs/test_vllm_doc.py",
)
VLLM_REFERENCE_UNIT = tuple(
    f"tests/integrations/vllm/{name}.py"
    for name in (
        "test_fleet",
        "test_pd_router",
        "test_vllm_connector",
        "test_vllm_no_prefix_cache",
        "test_vllm_server",
        "test_layerwise_vllm",  # layer-wise outputs against the same reference
        "test_model_families",  # no reference outputs: evens out the two units
        "test_sliding_windows",  # the same (about 75 s, two vLLM starts)
    )
)


def vllm_unit(nodeid: str) -> str | None:
    """The work unit of a test that starts vLLM, None for any other test."""
    if nodeid.startswith(VLLM_REFERENCE_UNIT):
        return "vllm-reference"
    return "vllm" if nodeid.startswith(VLLM_TESTS) else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class VllmUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return vllm_unit(nodeid) or nodeid

    return VllmUnits(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker: its vLLMs compute on its own share of this process's CPUs (the
    last share for the first worker, as vLLM's own binding picks the last CPUs), unless the
    environment already says where (``VLLM_CPU_OMP_THREADS_BIND``). Everywhere: the markers
    of tests/hosts.py."""
    hosts.pytest_configure(config)
    worker = getattr(config, "workerinput", None)
    if worker is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    count = int(worker["workercount"])
    index = int(worker["workerid"].removeprefix("gw"))
    if count < 2 or len(cpus) < count:
        return
    share = len(cpus) // count
    start = len(cpus) - (index + 1) * share
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[start : start + share]))


_SHM_AT_START: set[str] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # once, in the controller, under xdist
        _SHM_AT_START.update(shm_segments.names())
        start_recall_training()  # the codec quality gate's model: see tests/recall_training.py


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_recall_training()
    if not hasattr(session.config, "workerinput"):  # after every worker (and its vLLMs) ended
        count, size = shm_segments.sweep(_SHM_AT_START)
        if count:
            print(
                f"\n/dev/shm: removed {count} segments vLLM left behind ({size >> 20} MiB; "
                "tests/shm_segments.py says why)"
            )


SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
SMALL_CHUNK = 16  # tokens; chunk_bytes = 2*2*16*16*4 = 4096


@pytest.fixture
def layout() -> KVLayout:
    return SMALL_LAYOUT


def small_config(**overrides: object) -> Config:
    """A config for tests: small chunks, a buffer of ``cpu_chunks`` pages, no env/file."""
    cpu_chunks = int(overrides.pop("cpu_chunks", 8))  # type: ignore[call-overload]
    values: dict[str, object] = {
        "chunk_size": SMALL_CHUNK,
        "max_local_cpu_size": f"{cpu_chunks * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)}B",
    }
    values.update(overrides)
    return Config.load(overrides=values, env={})


def make_kv(num_tokens: int, seed: int = 0, layout: KVLayout = SMALL_LAYOUT) -> torch.Tensor:
    """Random-looking KV that every process computes bit for bit: integers from the seeded
    generator scaled by a power of two (exact), not randn, whose vectorized log/sin/cos
    can round differently in another process, and tests compare KV across processes."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-(2**15), 2**15, layout.kv_shape(num_tokens), generator=gen)
    return (ints.to(torch.float32) / 2**13).to(layout.dtype)


def make_tokens(num_tokens: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, 32000, (num_tokens,), generator=gen).tolist()


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """Opens engines and closes them at teardown, checking nothing leaked."""
    engines: list[Engine] = []

    def make(
        layout: KVLayout = SMALL_LAYOUT, model_name: str = "test-model", **overrides: object
    ) -> Engine:
        engine = Engine(small_config(**overrides), layout, model_name=model_name).open()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def service_factory() -> Iterator[Callable[..., Service]]:
    """Opens services (an engine with its admin API / PD receiver) and closes them."""
    services: list[Service] = []

    def make(
        layout: KVLayout = SMALL_LAYOUT, model_name: str = "test-model", **overrides: object
    ) -> Service:
        service = Service(small_config(**overrides), layout, model_name=model_name).open()
        services.append(service)
        return service

    yield make
    for service in services:
        service.close()


@pytest.fixture
def engine(engine_factory: Callable[..., Engine]) -> Engine:
    return engine_factory()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for one test module (started on a free port, removed after)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()
