"""kvtier's lines inside a host's logging (vLLM's), rate-limited warnings, per-request lines."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator

import pytest

from kvtier.engine import Engine
from kvtier.lease import RequestRecord
from kvtier.observability import logs
from tests.conftest import make_kv, make_tokens


@pytest.fixture
def host() -> Iterator[io.StringIO]:
    """A host logger with its own format, as vLLM's; kvtier's logging restored afterwards."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("HOST %(levelname)s [%(name)s] %(message)s"))
    host_logger = logging.getLogger("kvtier-test-host")
    host_logger.addHandler(handler)
    kvtier = logging.getLogger("kvtier")
    saved = (list(kvtier.handlers), kvtier.level, kvtier.propagate)
    try:
        yield out
    finally:
        host_logger.removeHandler(handler)
        kvtier.handlers, kvtier.level, kvtier.propagate = saved[0], saved[1], saved[2]
        logs._joined.discard("kvtier-test-host")


def test_kvtier_info_lines_go_out_in_the_host_format_once(
    host: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTIER_LOG_LEVEL", raising=False)
    assert logs.join_host_logging("kvtier-test-host")
    assert logs.join_host_logging("kvtier-test-host")  # twice: still one handler
    logging.getLogger("kvtier.storage.cpu").info("opened cpu tier: 8 chunks")
    lines = host.getvalue().splitlines()
    assert lines == ["HOST INFO [kvtier.storage.cpu] opened cpu tier: 8 chunks"]


def test_kvtier_log_level_turns_info_down(
    host: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "warning")
    logs.join_host_logging("kvtier-test-host")
    logging.getLogger("kvtier.requests").info("request r: ...")
    logging.getLogger("kvtier.x").warning("a warning")
    assert host.getvalue().splitlines() == ["HOST WARNING [kvtier.x] a warning"]


def test_repeated_warnings_are_rate_limited_and_counted() -> None:
    out = io.StringIO()
    inner = logging.StreamHandler(out)
    limited = logs.RateLimited(inner, window_s=3600)
    logger = logging.getLogger("kvtier.test.ratelimit")
    logger.addHandler(limited)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for i in range(50):
            logger.warning("redis down: %s", i)
        logger.warning("another warning")
        logger.info("info is never limited")
        logger.info("info is never limited")
        assert out.getvalue().splitlines() == [
            "redis down: 0",
            "another warning",
            "info is never limited",
            "info is never limited",
        ]
        limited.window_s = 0.0  # the window is over: the next one says what was dropped
        logger.warning("redis down: %s", 99)
        last = out.getvalue().splitlines()[-1]
        assert last == "redis down: 99 (49 more like this in the last 0 s)"
    finally:
        logger.removeHandler(limited)


def test_one_line_per_request_says_what_was_loaded_from_which_tier(
    engine_factory: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_factory(cpu_chunks=8)
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    prompt = tokens + make_tokens(5, seed=3)
    with caplog.at_level(logging.INFO, logger="kvtier.requests"):
        with engine.request("used"):
            engine.lookup(prompt, "used")
            engine.retrieve(prompt, "used")
        with engine.request("not-needed"):
            engine.lookup(prompt, "not-needed")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.requests"]
    assert lines == [
        "request used: 53 prompt tokens, loaded 48 tokens from kvtier (cpu 48)",
        "request not-needed: 53 prompt tokens, loaded 0 tokens from kvtier, "
        "found 48 (48 not needed: the engine had them)",
    ]
    record = RequestRecord()
    record.note_found(1408, 1024)
    record.note_loaded(1024, {"cpu": 768, "disk": 256})
    record.note_stored(256, 1408)
    with caplog.at_level(logging.INFO, logger="kvtier.requests"):
        line = logs.log_request_end("r", record)
        assert logs.log_request_end("bare-store", RequestRecord()) is None  # nothing noted
    assert line == (
        "request r: 1408 prompt tokens, loaded 1024 tokens from kvtier (cpu 768, disk 256), "
        "stored 256 new"
    )
