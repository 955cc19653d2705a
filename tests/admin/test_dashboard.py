"""The dashboard in a real headless Chromium (Debian's package) against a live engine.

The page loads, shows the tier occupancy the engine reports, and updates after a store
while it stays open. A screenshot is kept under artifacts/ as a test artifact.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier import Engine, Service
from tests.admin.chromium import Dom, run_chromium, screenshot
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens

TOKEN = "dashboard-token"
CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)  # 4 KiB
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@pytest.fixture
def service(service_factory: Callable[..., Service]) -> Service:
    return service_factory(
        cpu_chunks=8,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
        admin_token=TOKEN,
    )


@pytest.fixture
def engine(service: Service) -> Engine:
    return service.engine


def page_url(service: Service) -> str:
    assert service.admin_url is not None
    return f"{service.admin_url}/?token={TOKEN}"


def test_page_shows_occupancy_and_updates_after_a_store(
    service: Service, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))  # 3 chunks
    engine.lookup(tokens, "open-request")  # pins them: a lease for the table
    engine.retrieve(tokens, "open-request")  # loaded: the hit (a lookup alone only finds)
    later = make_tokens(32, seed=5)

    # The page polls /stats about once a second. Store 2 more chunks right before the
    # second poll is answered, so one page instance sees 3 chunks, then 5.
    admin = service.admin
    assert admin is not None
    real_payload = admin.stats_payload
    calls = {"n": 0}

    def payload_with_a_store_before_the_second_poll() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            engine.store(later, make_kv(32, seed=5))
        return real_payload()

    monkeypatch.setattr(admin, "stats_payload", payload_with_a_store_before_the_second_poll)

    html = run_chromium(page_url(service), "--dump-dom", virtual_ms=4500)
    dom = Dom(html)

    assert calls["n"] >= 3, "the page did not keep polling /stats"
    polls = re.search(r'<body data-polls="(\d+)"', html)
    assert polls is not None and int(polls.group(1)) >= 3  # renders that completed
    cpu = dom.attrs["tier-cpu"]
    stats = engine.stats()["tiers"]["cpu"]
    assert stats["entries"] == 5
    assert cpu["data-entries"] == "5"
    assert cpu["data-used-bytes"] == str(5 * CHUNK_BYTES) == str(stats["used_bytes"])
    assert cpu["data-capacity-bytes"] == str(8 * CHUNK_BYTES)
    assert "20.0 KiB of 32.0 KiB" in dom.text["tier-cpu"]
    assert "5 chunks" in dom.text["tier-cpu"]
    # The same page saw the change happen: its activity feed logs 3 -> 5.
    assert "cpu 3 \u2192 5 chunks" in dom.text["activity"]
    assert dom.text["status"].startswith("live")
    assert dom.text["hit-rate"] == "100.0%"
    assert "loaded from kvtier" in dom.text["hit-detail"]
    assert dom.text["lease-count"] == "1"
    assert "open-request" in dom.text["leases"]
    assert "PD is off" in dom.text["pd"]
    assert "open-request" in dom.text["requests"]
    # found, loaded, unused as the counters name them; unused is set when the request ends
    assert "found" in dom.text["requests"] and "unused" in dom.text["requests"]
    assert "open-request484848\u2013" in dom.text["requests"].replace(" ", "")
    engine.end_request("open-request")


def test_explain_link_renders_the_chunk_table(service: Service, engine: Engine) -> None:
    tokens = make_tokens(32)
    engine.store(tokens, make_kv(32))
    engine.lookup(tokens + make_tokens(20, seed=3), "asked")
    engine.end_request("asked")
    dom = Dom(run_chromium(page_url(service) + "#explain=asked", "--dump-dom", virtual_ms=1500))
    text = dom.text["explain"]
    assert "explain asked" in text
    assert "0\u20131" in text and "found in cpu" in text  # chunks 0-1 found in the CPU tier
    assert "not stored" in text and "partial chunk" in text


def test_page_without_the_token_is_refused(service: Service) -> None:
    assert service.admin_url is not None
    html = run_chromium(service.admin_url + "/", "--dump-dom", virtual_ms=1000)
    assert "missing or wrong bearer token" in html
    assert "tier-cpu" not in html and "kvtier dashboard" not in html


def test_screenshot_is_kept_as_an_artifact(service: Service, engine: Engine) -> None:
    for i in range(3):
        tokens = make_tokens(32, seed=10 + i)
        engine.store(tokens, make_kv(32, seed=10 + i))
        engine.lookup(tokens + make_tokens(16, seed=20 + i), f"chat-{i}")
    engine.end_request("chat-0")
    path = ARTIFACTS / "dashboard.png"
    path.unlink(missing_ok=True)
    screenshot(page_url(service), path)
    assert path.stat().st_size > 20_000  # a rendered page, not a blank frame
    for i in (1, 2):
        engine.end_request(f"chat-{i}")
