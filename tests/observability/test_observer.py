"""The engine's observability hooks: TTFT reports, latency snapshot, guarded explain."""

from __future__ import annotations

import logging

import pytest

from kvtier import Engine
from tests.conftest import make_kv, make_tokens


@pytest.mark.parametrize(
    ("seconds", "prompt", "hit"),
    [(-1.0, 10, 0), (0.1, 10, 11), (0.1, 10, -1), (float("nan"), 1, 0)],
)
def test_record_ttft_rejects_impossible_reports(
    engine: Engine, seconds: float, prompt: int, hit: int
) -> None:
    with pytest.raises(ValueError, match="record_ttft"):
        engine.record_ttft(seconds, prompt_tokens=prompt, hit_tokens=hit)
    assert engine.observer.snapshot()["ttft"]["reported_requests"] == 0


def test_snapshot_counts_each_operation(engine: Engine) -> None:
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    engine.lookup(tokens, "r")
    engine.retrieve(tokens, "r")
    engine.end_request("r")
    snap = engine.observer.snapshot()
    assert {op: v["count"] for op, v in snap["latency"].items()} == {
        "lookup": 1,
        "store": 1,
        "retrieve": 1,
    }
    assert snap["lookup_hit_tokens_by_tier"] == {"cpu": 32}
    assert snap["explain_records"] == 1
    assert engine.observer.lease_seconds.snapshot().count == 1


def test_a_failing_explain_hook_never_fails_the_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("explain bug")

    monkeypatch.setattr(engine.observer.explain, "record_lookup", broken)
    tokens = make_tokens(16)
    engine.store(tokens, make_kv(16))
    with caplog.at_level(logging.ERROR, logger="kvtier.observability.observer"):
        assert engine.lookup(tokens, "r").tokens == 16
    assert "explain hook broken failed; the request is unaffected" in caplog.text
    assert engine.counters.lookups == 1
    engine.end_request("r")
