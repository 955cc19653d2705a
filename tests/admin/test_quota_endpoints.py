"""``GET /quotas`` and ``PUT /quota``: a tenant's quota changed at run time, authenticated
like the rest of the admin API, applied to the CPU tier at once."""

from __future__ import annotations

from collections.abc import Callable

from kvtier import Service
from tests.admin.client import call
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens

TOKEN = "t0ken-for-quota-tests"
CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


def open_service(service_factory: Callable[..., Service], **overrides: object) -> Service:
    return service_factory(
        cpu_chunks=16,
        internal_api_server_enabled=True,
        internal_api_server_port_start=0,
        admin_token=TOKEN,
        **overrides,
    )


def test_a_quota_set_at_run_time_evicts_the_tenant_down_to_it(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"*": "100%"})
    url, engine = service.admin_url or "", service.engine
    for seed in range(3):
        tokens = make_tokens(4 * SMALL_CHUNK, seed)
        engine.store(tokens, make_kv(4 * SMALL_CHUNK, seed), cache_salt="big")
    reply = call(url, f"/quota?tenant=big&limit={4 * CHUNK_BYTES}B", method="PUT", token=TOKEN)
    assert reply.status == 200, reply.body
    assert reply.json() == {"tenant": "big", "limit": "16.00 KiB"}
    listing = call(url, "/quotas", token=TOKEN).json()
    assert listing["quotas"] == {"*": "100%", "big": "16.00 KiB"}
    assert listing["tiers"]["cpu"]["big"]["held_bytes"] == 4 * CHUNK_BYTES
    assert listing["tiers"]["cpu"]["big"]["quota_evictions"] == 8
    removed = call(url, "/quota?tenant=big&limit=none", method="PUT", token=TOKEN)
    assert removed.json() == {"tenant": "big", "limit": "none"}
    assert call(url, "/quotas", token=TOKEN).json()["quotas"] == {"*": "100%"}


def test_quota_endpoints_refuse_without_the_token_and_name_bad_input(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"a": "10%"})
    url = service.admin_url or ""
    for token in (None, "wrong-token-wrong-token"):
        assert call(url, "/quota?tenant=a&limit=50%25", method="PUT", token=token).status == 401
        assert call(url, "/quotas", token=token).status == 401
    assert call(url, "/quotas", token=TOKEN).json()["quotas"] == {"a": "10%"}  # unchanged
    bad = call(url, "/quota?tenant=a&limit=150%25", method="PUT", token=TOKEN)
    assert bad.status == 400 and "150%" in bad.json()["error"] and "share" in bad.json()["error"]
    for limit in ("1e20", "1e300", "9" * 400, "nan", "inf", "1048577", "2PiB"):
        huge = call(url, f"/quota?tenant=a&limit={limit}", method="PUT", token=TOKEN)
        assert huge.status == 400 and "from 0 to 1 PiB" in huge.json()["error"], limit
    missing = call(url, "/quota?tenant=a", method="PUT", token=TOKEN)
    assert missing.status == 400 and "limit" in missing.json()["error"]
    assert call(url, "/quota?tenant=a&limit=1GiB", token=TOKEN).status == 405  # GET


def test_quota_endpoints_say_how_to_turn_quotas_on(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory)
    reply = call(service.admin_url or "", "/quotas", token=TOKEN)
    assert reply.status == 409 and "tenant_quotas" in reply.json()["error"]
