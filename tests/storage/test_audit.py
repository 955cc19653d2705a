"""The reference audit must see each kind of break it claims to see."""

from __future__ import annotations

from kvtier import Engine
from kvtier.storage.audit import audit_references
from tests.conftest import make_kv, make_tokens


def parts(engine: Engine):  # type: ignore[no-untyped-def]
    return engine._open_parts()


def test_a_clean_engine_passes(engine: Engine) -> None:
    engine.store(make_tokens(32), make_kv(32))
    engine.lookup(make_tokens(32), "r")
    assert audit_references(*parts(engine)) == []
    engine.end_request("r")
    assert audit_references(*parts(engine)) == []


def test_a_reference_nobody_owns_is_a_leak(engine: Engine) -> None:
    engine.store(make_tokens(16), make_kv(16))
    manager, leases = parts(engine)
    (entry,) = manager.cpu.entries([next(iter(manager.cpu._index))])
    assert entry is not None
    manager.pool.retain([entry.page])  # taken, and recorded nowhere
    assert any("(leaked)" in p for p in audit_references(manager, leases))
    manager.pool.release([entry.page])


def test_a_page_freed_under_its_owner_is_reported(engine: Engine) -> None:
    engine.store(make_tokens(16), make_kv(16))
    manager, leases = parts(engine)
    (entry,) = manager.cpu.entries([next(iter(manager.cpu._index))])
    assert entry is not None
    manager.pool.release([entry.page])  # the cache entry still points at it
    problems = audit_references(manager, leases)
    assert any("freed while in use" in p for p in problems)
    manager.pool.allocate(manager.pool.free_pages)  # leave the pool consistent for close


def test_an_evicted_pinned_chunk_is_reported(engine: Engine) -> None:
    tokens = make_tokens(16)
    engine.store(tokens, make_kv(16))
    engine.lookup(tokens, "r")
    manager, leases = parts(engine)
    manager.cpu.remove(next(iter(manager.cpu._index)))  # what a buggy eviction would do
    assert any("was evicted" in p for p in audit_references(manager, leases))
    engine.end_request("r")
