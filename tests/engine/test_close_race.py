"""close() racing calls on other threads: every call either works or raises StateError, and
close waits (bounded) for the calls in flight before it frees anything."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier import Engine
from kvtier.errors import StateError
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisServer, wait_until

PROMPTS = [(make_tokens(64, seed=70 + i), make_kv(64, seed=70 + i)) for i in range(4)]


class Tally:
    """What the hammering threads did: calls that worked, calls refused after close."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.refused = 0

    def add(self, *, done: int = 0, refused: int = 0) -> None:
        with self.lock:
            self.done += done
            self.refused += refused


def _hammer(engine: Engine, worker: int, errors: list[str], tally: Tally) -> None:
    """Lookups, retrieves, stores and ends in a loop until the engine refuses (a closed engine
    refuses every call, so each worker ends on a refusal, or a hang the test reports)."""
    n = 0
    while True:
        n += 1
        tokens, kv = PROMPTS[(worker + n) % len(PROMPTS)]
        rid = f"w{worker}-{n}"
        out = torch.zeros_like(kv)
        calls: list[tuple[Callable[..., object], tuple[object, ...]]] = [
            (engine.store, (tokens, kv)),
            (engine.lookup, (tokens, rid)),
            (engine.retrieve, (tokens, rid)),
            (engine.retrieve_into, (tokens, rid, out)),
            (engine.stats, ()),
            (engine.end_request, (rid,)),
        ]
        for call, args in calls:
            try:
                call(*args)
            except StateError:
                tally.add(refused=1)
                return  # closed: the only acceptable refusal
            except BaseException as exc:  # anything else is the bug
                errors.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
                return
            tally.add(done=1)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.mark.parametrize("tiers", ["cpu", "disk", "redis"])
def test_calls_racing_close_get_state_error_and_nothing_else(
    tmp_path: Path, tiers: str, request: pytest.FixtureRequest
) -> None:
    extra: dict[str, object] = {}
    if tiers == "disk":
        extra = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": "4MiB"}
    if tiers == "redis":
        extra = {"remote_url": request.getfixturevalue("redis_url"), "local_cpu": False}
    errors: list[str] = []
    for round_ in range(12):
        engine = Engine(
            small_config(cpu_chunks=32, blocking_timeout_secs=5.0, **extra),
            SMALL_LAYOUT,
            model_name="race",
        ).open()
        tally = Tally()
        workers = [
            threading.Thread(target=_hammer, args=(engine, i, errors, tally), daemon=True)
            for i in range(6)
        ]
        for worker in workers:
            worker.start()
        # Close in the middle of their calls, at a different point each round: once 6 to 24
        # calls have worked (a close before any call would test only a closed engine).
        calls_before_close = 6 * (round_ % 4 + 1)
        wait_until(
            lambda tally=tally, at=calls_before_close: tally.done >= at or bool(errors),
            30,
            f"{calls_before_close} calls to work before close (round {round_})",
        )
        engine.close()
        for worker in workers:
            worker.join(30)
            assert not worker.is_alive(), "a call hung after close"
        assert errors == [], errors[:5]
        assert tally.done >= calls_before_close
        # Every worker was still calling when close came and ended on a refusal.
        assert tally.refused == len(workers), (round_, tally.refused)
