"""LMCache's ``PUT`` / ``DELETE /api/quota/{cache_salt}`` on kvtier's admin API: the same
request body and answers as LMCache's quota API, changing kvtier's quota table (every tier at
once), behind the same bearer token."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kvtier import Service
from kvtier.admin.lmcache_quota import AliasError, limit_of_body, salt_of_path
from kvtier.config.sizes import GIB
from tests.admin.client import call
from tests.admin.test_quota_endpoints import CHUNK_BYTES, TOKEN, open_service
from tests.conftest import SMALL_CHUNK, make_kv, make_tokens


def put(url: str, salt: str, body: object, token: str | None = TOKEN) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = call(url, f"/api/quota/{salt}", method="PUT", token=token, body=data)
    return reply.status, reply.json()


def test_lmcaches_put_sets_kvtiers_quota_and_the_tier_evicts_down_to_it(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"*": "100%"})
    url, engine = service.admin_url or "", service.engine
    for seed in range(3):
        tokens = make_tokens(4 * SMALL_CHUNK, seed)
        engine.store(tokens, make_kv(4 * SMALL_CHUNK, seed), cache_salt="alice")
    limit_gb = 4 * CHUNK_BYTES / GIB
    status, answer = put(url, "alice", {"limit_gb": limit_gb})
    assert status == 200
    assert answer == {"cache_salt": "alice", "limit_gb": limit_gb, "status": "ok"}
    listing = call(url, "/quotas", token=TOKEN).json()
    assert listing["quotas"]["alice"] == "16.00 KiB"
    assert listing["tiers"]["cpu"]["alice"]["held_bytes"] == 4 * CHUNK_BYTES  # applied at once
    removed = call(url, "/api/quota/alice", method="DELETE", token=TOKEN)
    assert removed.status == 200
    assert removed.json() == {"cache_salt": "alice", "status": "removed"}
    assert call(url, "/quotas", token=TOKEN).json()["quotas"] == {"*": "100%"}
    again = call(url, "/api/quota/alice", method="DELETE", token=TOKEN).json()
    assert again == {"cache_salt": "alice", "status": "not_found"}


def test_default_in_the_path_is_the_empty_salt_and_a_quoted_salt_is_unquoted(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"*": "100%"})
    url = service.admin_url or ""
    assert put(url, "_default", {"limit_gb": 2}) == (
        200,
        {"cache_salt": "_default", "limit_gb": 2.0, "status": "ok"},
    )
    assert put(url, "team%20a", {"limit_gb": 0.5})[0] == 200
    quotas = call(url, "/quotas", token=TOKEN).json()["quotas"]
    assert quotas == {"*": "100%", "": "2.00 GiB", "team a": "512.00 MiB"}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "invalid JSON"),
        ({"limit": 1}, "limit_gb"),
        ({"limit_gb": "ten"}, "'ten'"),
        ({"limit_gb": True}, "True"),
        ({"limit_gb": -1}, ">= 0"),
        (b'{"limit_gb": NaN}', "finite"),
        (b'{"limit_gb": Infinity}', "finite"),
        # Out of range: 1e300 GiB is inf bytes, 400 digits do not fit a float (both were a
        # 500), and 1e20 GiB was taken although PUT /quota refuses it and a saved table
        # holding it is unreadable.
        (b'{"limit_gb": 1e300}', "at most 1048576 (GiB: 1 PiB), got 1e+300"),
        (b'{"limit_gb": 1' + b"0" * 399 + b"}", "an integer of about 400 digits"),
        ({"limit_gb": 1e20}, "at most 1048576"),
        ({"limit_gb": 1048577}, "at most 1048576"),
        ({"limit_gb": "1e400"}, "'1e400'"),
        (b"[" * 4000, "invalid JSON"),  # a RecursionError in the parser, once a 500
    ],
)
def test_a_bad_body_is_a_400_naming_the_value_and_changes_nothing(
    service_factory: Callable[..., Service], body: object, says: str
) -> None:
    service = open_service(service_factory, tenant_quotas={"a": "10%"})
    url = service.admin_url or ""
    status, answer = put(url, "a", body)
    assert status == 400 and says in answer["error"]  # type: ignore[index]
    assert call(url, "/quotas", token=TOKEN).json()["quotas"] == {"a": "10%"}


def test_the_alias_needs_the_token_and_takes_put_or_delete_only(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"a": "10%"})
    url = service.admin_url or ""
    for token in (None, "wrong-token-wrong-token"):
        assert put(url, "a", {"limit_gb": 1}, token=token)[0] == 401
        assert call(url, "/api/quota/a", method="DELETE", token=token).status == 401
    assert call(url, "/quotas", token=TOKEN).json()["quotas"] == {"a": "10%"}  # unchanged
    get = call(url, "/api/quota/a", token=TOKEN)
    assert get.status == 405 and "PUT or DELETE" in get.json()["error"]
    assert call(url, "/api/quota/", method="PUT", token=TOKEN, body=b"{}").status == 400


def test_the_alias_says_how_to_turn_quotas_on(service_factory: Callable[..., Service]) -> None:
    service = open_service(service_factory)
    status, answer = put(service.admin_url or "", "a", {"limit_gb": 1})
    assert status == 409 and "tenant_quotas" in answer["error"]  # type: ignore[index]


def test_parsing_alone() -> None:
    assert salt_of_path("/api/quota/_default") == ""
    assert salt_of_path("/api/quota/a%2Fb") == "a/b"
    assert limit_of_body(b'{"limit_gb": 1.5}')[1].nbytes == int(1.5 * GIB)
    assert limit_of_body(b'{"limit_gb": 0}')[1].nbytes == 0  # LMCache's 0: hold nothing
    assert limit_of_body(b'{"limit_gb": 1048576}')[1].nbytes == 1024**5  # the bound itself
    with pytest.raises(AliasError, match="over 1024"):
        salt_of_path("/api/quota/" + "s" * 1025)


def test_a_limit_of_zero_gb_leaves_the_salt_nothing_as_in_lmcache(
    service_factory: Callable[..., Service],
) -> None:
    service = open_service(service_factory, tenant_quotas={"*": "100%"})
    url, engine = service.admin_url or "", service.engine
    tokens = make_tokens(4 * SMALL_CHUNK, 1)
    engine.store(tokens, make_kv(4 * SMALL_CHUNK, 1), cache_salt="gone")
    assert put(url, "gone", {"limit_gb": 0})[0] == 200
    assert call(url, "/quotas", token=TOKEN).json()["tiers"]["cpu"]["gone"]["held_bytes"] == 0
    engine.store(tokens, make_kv(4 * SMALL_CHUNK, 1), cache_salt="gone")
    with engine.request("r"):
        assert engine.lookup(tokens, "r", cache_salt="gone").tokens == 0
