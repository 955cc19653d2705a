"""The admin HTTP API against a live engine: every endpoint, auth, and bad input."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier import Config, Engine, Service
from kvtier.admin.server import AdminServer
from kvtier.errors import StateError
from tests.admin.client import Reply, call, raw
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

TOKEN = "t0ken-for-tests"
CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
PROTECTED = ["/", "/metrics", "/stats", "/history", "/config", "/leases", "/requests"]


@pytest.fixture
def admin_service(service_factory: Callable[..., Service]) -> Service:
    return service_factory(
        cpu_chunks=8,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
        admin_token=TOKEN,
    )


@pytest.fixture
def admin_engine(admin_service: Service) -> Engine:
    return admin_service.engine


@pytest.fixture
def url(admin_service: Service) -> str:
    assert admin_service.admin_url is not None
    return admin_service.admin_url


def get(url: str, path: str, token: str | None = TOKEN) -> Reply:
    return call(url, path, token=token)


# -- lifecycle ---------------------------------------------------------------------------------
def test_open_starts_and_close_stops_the_server() -> None:
    config = small_config(internal_api_server_enabled=True, internal_api_server_port_start=0)
    service = Service(config, SMALL_LAYOUT, model_name="test-model")
    assert service.admin_url is None  # the constructor starts nothing
    service.open()
    url = service.admin_url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert get(url, "/health", None).json() == {"status": "ok"}
    service.close()
    assert service.admin_url is None  # stopped: the port no longer answers
    assert service.engine.state.value == "closed"  # closed after its server
    with pytest.raises(OSError):
        call(url, "/health")


def test_off_by_default(service_factory: Callable[..., Service]) -> None:
    service = service_factory()
    assert service.admin is None and service.admin_url is None


def test_an_engine_alone_serves_nothing(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(internal_api_server_enabled=True, internal_api_server_port_start=0)
    assert not hasattr(engine, "admin") and not hasattr(engine, "admin_url")


def busy_port_below_the_top(room: int) -> socket.socket:
    """A listening socket on a kernel-chosen port with ``room`` ports above it (asked again,
    holding the ones that were too high, until one fits)."""
    too_high: list[socket.socket] = []
    try:
        while True:
            busy = socket.socket()
            busy.bind(("127.0.0.1", 0))
            if busy.getsockname()[1] <= 65535 - room:
                busy.listen()
                return busy
            too_high.append(busy)
    finally:
        for sock in too_high:
            sock.close()


def test_port_start_moves_past_a_busy_port(service_factory: Callable[..., Service]) -> None:
    with busy_port_below_the_top(16) as busy:
        port = busy.getsockname()[1]
        service = service_factory(
            internal_api_server_enabled=True, internal_api_server_port_start=port
        )
        assert service.admin is not None
        assert port < service.admin.port < port + 16


def test_unbindable_host_leaves_the_engine_working(
    service_factory: Callable[..., Service], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        service = service_factory(
            internal_api_server_enabled=True,
            internal_api_server_host="203.0.113.1",  # TEST-NET-3: not an address of this host
            internal_api_server_port_start=0,
        )
    assert service.admin is None
    assert "admin API not started" in caplog.text
    engine = service.engine
    engine.store(make_tokens(16), make_kv(16))  # the cache itself is unaffected
    assert engine.lookup(make_tokens(16), "r").tokens == 16
    engine.end_request("r")


def test_engine_not_open_answers_503() -> None:
    engine = Engine(small_config(), SMALL_LAYOUT, model_name="test-model")
    with AdminServer(engine) as server:
        assert call(server.url, "/health").status == 503
        reply = call(server.url, "/stats")
        assert reply.status == 503 and "not open" in reply.json()["error"]
    with pytest.raises(StateError):
        _ = server.port  # stopped


# -- auth --------------------------------------------------------------------------------------
def test_health_needs_no_token(url: str) -> None:
    reply = get(url, "/health", None)
    assert reply.status == 200 and reply.json() == {"status": "ok"}


@pytest.mark.parametrize("path", PROTECTED)
def test_every_other_endpoint_needs_the_token(url: str, path: str) -> None:
    missing = get(url, path, None)
    assert missing.status == 401 and missing.json() == {"error": "missing or wrong bearer token"}
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert get(url, path, "wrong").status == 401
    assert call(url, path, headers={"Authorization": f"Basic {TOKEN}"}).status == 401
    assert get(url, path).status == 200


def test_post_clear_needs_the_token(url: str) -> None:
    assert call(url, "/clear", method="POST").status == 401
    assert call(url, "/clear", method="POST", token="nope").status == 401
    assert call(url, "/clear", method="POST", token=TOKEN).status == 200


def test_explain_needs_the_token_before_it_says_404(url: str) -> None:
    assert get(url, "/explain?request_id=nobody", None).status == 401


def test_query_token_opens_the_page_for_a_browser(url: str) -> None:
    assert get(url, f"/?token={TOKEN}", None).status == 200
    assert get(url, "/?token=wrong", None).status == 401


def test_token_from_the_environment() -> None:
    config = Config.load(
        overrides={
            "chunk_size": SMALL_CHUNK,
            "max_local_cpu_size": f"{4 * CHUNK_BYTES}B",
            "internal_api_server_enabled": True,
            "internal_api_server_port_start": 0,
        },
        env={"KVTIER_ADMIN_TOKEN": "from-env"},
    )
    with Service(config, SMALL_LAYOUT, model_name="test-model") as service:
        assert service.admin_url is not None
        assert get(service.admin_url, "/stats", None).status == 401
        reply = get(service.admin_url, "/config", "from-env")
        assert reply.status == 200
        assert reply.json()["config"]["admin_token"] == "***"
        assert "from-env" not in reply.body.decode()


# -- endpoints ---------------------------------------------------------------------------------
def test_stats_config_leases_and_metrics(admin_engine: Engine, url: str) -> None:
    tokens = make_tokens(48)
    admin_engine.store(tokens, make_kv(48))
    admin_engine.lookup(tokens[:32], "req-1")

    stats = get(url, "/stats").json()
    assert stats["tiers"]["cpu"]["entries"] == 3
    assert stats["tiers"]["cpu"]["used_bytes"] == 3 * CHUNK_BYTES
    assert stats["open_requests"] == 1 and stats["pinned_pages"] == 2
    assert stats["engine"]["model_name"] == "test-model"
    assert stats["engine"]["fingerprint"] == admin_engine.fingerprint.hex()
    assert stats["observability"]["latency"]["lookup"]["count"] == 1

    config = get(url, "/config").json()
    assert config["config"]["chunk_size"] == SMALL_CHUNK
    assert config["config"]["admin_token"] == "***"
    assert TOKEN not in get(url, "/config").body.decode()

    leases = get(url, "/leases").json()["leases"]
    assert len(leases) == 1
    assert leases[0]["request_id"] == "req-1"
    assert leases[0]["pinned_pages"] == 2 and leases[0]["pinned_bytes"] == 2 * CHUNK_BYTES
    assert leases[0]["age_s"] >= 0 and leases[0]["since"] <= stats["time"] + 1

    metrics = get(url, "/metrics")
    assert metrics.headers["Content-Type"].startswith("text/plain")
    text = metrics.body.decode()
    assert "kvtier_lookups_total 1.0" in text
    assert 'kvtier_tier_entries{tier="cpu"} 3.0' in text

    admin_engine.end_request("req-1")
    assert get(url, "/leases").json() == {"leases": []}
    assert get(url, "/history").json()["points"]  # the sampler took one at start


def test_explain_and_requests(admin_engine: Engine, url: str) -> None:
    tokens = make_tokens(32)
    admin_engine.store(tokens, make_kv(32))
    admin_engine.lookup(tokens + make_tokens(16, seed=4), "req-7")
    admin_engine.end_request("req-7")  # explain outlives the request
    record = get(url, "/explain?request_id=req-7").json()
    assert record["request_id"] == "req-7"
    assert [c.get("tier", c.get("reason")) for c in record["chunks"]] == [
        "cpu",
        "cpu",
        "not stored",
    ]
    recent = get(url, "/requests?limit=5").json()["requests"]
    assert recent[0]["request_id"] == "req-7" and recent[0]["found_tokens"] == 32
    assert recent[0]["loaded_tokens"] == 0 and recent[0]["unused_tokens"] == 32
    odd = "id with spaces/and?marks&="
    admin_engine.lookup(tokens, odd)
    admin_engine.end_request(odd)
    from urllib.parse import quote

    assert get(url, f"/explain?request_id={quote(odd, safe='')}").json()["request_id"] == odd


def test_explain_unknown_id_is_404(url: str) -> None:
    reply = get(url, "/explain?request_id=never-seen")
    assert reply.status == 404
    assert "never-seen" in reply.json()["error"]


def test_clear_never_drops_pinned_entries(admin_engine: Engine, url: str) -> None:
    tokens = make_tokens(48)
    admin_engine.store(tokens, make_kv(48))
    assert admin_engine.lookup(tokens[:32], "pinning").tokens == 32  # chunks 0 and 1 pinned
    reply = call(url, "/clear", method="POST", token=TOKEN)
    assert reply.status == 200 and reply.json() == {"dropped": {"cpu": 1}}
    assert admin_engine.stats()["tiers"]["cpu"]["entries"] == 2
    out = admin_engine.retrieve(tokens[:32], "pinning")  # the pinned chunks still serve
    assert out.shape[2] == 32
    assert admin_engine.end_request("pinning")
    assert call(url, "/clear", method="POST", token=TOKEN).json() == {"dropped": {"cpu": 2}}
    assert admin_engine.check_invariants() == []


def test_clear_with_a_tier_down_is_503_and_clears_the_rest(
    service_factory: Callable[..., Service],
) -> None:
    with socket.socket() as probe:  # a port nothing listens on: Redis is "down"
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = service_factory(
        remote_url=f"redis://127.0.0.1:{port}",
        blocking_timeout_secs=0.5,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
    )
    engine = service.engine
    assert service.admin_url is not None
    engine.store(make_tokens(16), make_kv(16))
    reply = call(service.admin_url, "/clear", method="POST")
    assert reply.status == 503
    assert reply.json()["error"].startswith("clear dropped {'cpu': 1} but failed on redis")
    assert engine.stats()["tiers"]["cpu"]["entries"] == 0


def test_dashboard_is_self_contained(url: str) -> None:
    reply = get(url, "/")
    assert reply.headers["Content-Type"].startswith("text/html")
    page = reply.body.decode()
    assert "<title>kvtier dashboard</title>" in page and "function poll()" in page
    for external in ('src="http', 'href="http', "src='http", "@import", "cdn"):
        assert external not in page


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/explain", 400, "request_id is required"),
        ("GET", "/explain?request_id=", 400, "request_id is required"),
        ("GET", "/explain?request_id=" + "x" * 300, 400, "over 256 characters"),
        ("GET", "/explain?request_id=a&request_id=b", 400, "given 2 times"),
        ("GET", "/explain?rid=a", 400, "unknown parameter 'rid'"),
        ("GET", "/explain?request_id", 400, "malformed query string"),
        ("GET", "/stats?verbose=1", 400, "unknown parameter 'verbose'"),
        ("GET", "/requests?limit=0", 400, "limit must be an integer in [1, 1000]"),
        ("GET", "/requests?limit=-3", 400, "limit must be an integer"),
        ("GET", "/requests?limit=1e3", 400, "limit must be an integer"),
        ("GET", "/requests?limit=99999999999999999999", 400, "limit must be an integer"),
        # Unicode digits: str.isdigit() accepts them, int() does not (superscript two,
        # Arabic-Indic three).
        ("GET", "/requests?limit=%C2%B2", 400, "limit must be an integer"),
        ("GET", "/requests?limit=%D9%A3", 400, "limit must be an integer"),
        ("GET", "/nope", 404, "no endpoint '/nope'"),
        ("GET", "/clear", 405, "/clear takes POST, not GET"),
        ("POST", "/stats", 405, "/stats takes GET, not POST"),
        ("DELETE", "/stats", 405, "takes GET"),
        ("GET", "/requests?" + "&".join(f"p{i}=1" for i in range(40)), 400, "malformed query"),
    ],
)
def test_bad_requests_get_4xx_with_a_message(
    url: str, method: str, path: str, status: int, message: str
) -> None:
    reply = call(url, path, method=method, token=TOKEN)
    assert reply.status == status
    error = reply.json()["error"]
    assert message in error
    assert "Traceback" not in reply.body.decode()


def test_oversized_body_is_413(url: str) -> None:
    reply = call(url, "/clear", method="POST", token=TOKEN, body=b"x" * 10_000)
    assert reply.status == 413


def test_garbage_request_lines_get_json_errors(url: str) -> None:
    answer = raw(url, b"GET /stats HTTP/1.x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400")
    assert b"application/json" in head
    assert body == b'{"error": "Bad request version (\'HTTP/1.x\')"}'
    for garbage, status in (
        (b"THIS IS NOT HTTP\r\n\r\n", b"400"),
        (b"GET /stats HTTP/2.0\r\n\r\n", b"505"),
        (b"GET /stats HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (
            b"POST /clear HTTP/1.1\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nContent-Length: abc\r\n\r\n",
            b"400",
        ),
        (  # a superscript two (latin-1 byte 0xB2): isdigit() but not int()
            b"POST /clear HTTP/1.1\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nContent-Length: \xb2\r\n\r\n",
            b"400",
        ),
    ):
        head, _, body = raw(url, garbage).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 " + status), head
        assert body.startswith(b'{"error": ') and b"Traceback" not in body


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    path=st.sampled_from(["/explain", "/requests", "/leases", "/stats"]),
    query=st.one_of(
        # anything printable, from the whole of Unicode (surrogates cannot be encoded)
        st.text(
            alphabet=st.characters(
                min_codepoint=32, exclude_categories=["Cs"], exclude_characters="#"
            ),
            max_size=40,
        ),
        # a known parameter whose value is made of digits and numbers from any script
        st.builds(
            "{}={}".format,
            st.sampled_from(["limit", "request_id"]),
            st.text(alphabet=st.characters(categories=["Nd", "No", "Nl"]), min_size=1),
        ),
    ),
)
@example(path="/requests", query="limit=\u00b2")
@example(path="/requests", query="limit=\u0663")
def test_fuzzed_queries_never_reach_the_bug_handler(
    admin_engine: Engine, url: str, path: str, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    from urllib.parse import quote

    with caplog.at_level(logging.ERROR, logger="kvtier.admin.server"):
        reply = call(url, path + "?" + quote(query, safe="=&%+"), token=TOKEN)
    assert reply.status in (200, 400, 404), (reply.status, reply.body)
    assert "admin API bug" not in caplog.text


def test_bug_handler_answers_500_without_a_traceback(
    admin_service: Service, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real bug (an exception no endpoint expects) is logged and answered as a bare 500.
    def broken() -> dict[str, object]:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(admin_service.admin, "stats_payload", broken)
    reply = get(url, "/stats")
    assert reply.status == 500
    assert reply.json() == {"error": "internal error (logged)"}


def test_scrapes_during_traffic_see_consistent_state(admin_engine: Engine, url: str) -> None:
    import threading

    errors: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            for path in ("/metrics", "/stats", "/leases", "/requests", "/history"):
                reply = get(url, path)
                if reply.status != 200:
                    errors.append(f"{path}: {reply.status} {reply.body[:200]!r}")

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for t in scrapers:
        t.start()
    try:
        for i in range(40):
            tokens = make_tokens(48, seed=i % 5)
            with admin_engine.request(f"w{i}") as rid:
                admin_engine.lookup(tokens, rid)
                admin_engine.retrieve(tokens, rid)
                admin_engine.store(tokens, make_kv(48, seed=i % 5))
    finally:
        done.set()
        for t in scrapers:
            t.join()
    assert errors == []
    assert admin_engine.check_invariants() == []
    text = get(url, "/metrics").body.decode()
    assert "kvtier_lookups_total 40.0" in text and "kvtier_requests_total 40.0" in text
