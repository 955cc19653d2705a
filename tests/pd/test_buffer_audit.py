"""The PD buffer's page audit (kvtier.pd.buffer_audit): a reference without an owner and an
index entry on a free page are each reported by themselves, and the engine's audit finds an
owner for every reference of a decoder's buffer."""

from __future__ import annotations

import os

from kvtier import Engine
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.buffer_audit import page_problems
from kvtier.pd.received_index import ReceivedIndex
from kvtier.storage.key_pins import KeyPins
from tests.conftest import SMALL_LAYOUT, small_config
from tests.storage.tier_contract import CONTRACT_CHUNK, random_key


def test_an_unowned_reference_and_an_entry_on_a_free_page_are_each_reported() -> None:
    pool, index, pins = BlockPool(4, 64), ReceivedIndex(), KeyPins()
    held = pool.allocate(2)
    assert held is not None
    entry = os.urandom(16)
    index.add(entry, held[0], 1)
    pins.record(os.urandom(16), held[1])
    pool.retain([held[1]])
    assert page_problems(pool, index, pins, {held[0]: 1, held[1]: 1}) == []
    assert page_problems(pool, index, pins, {held[0]: 1}) == [
        f"page {held[1]}: refcount 2, owners 1"
    ]
    pool.release([held[0]])  # the entry's page is free: nobody may find it any more
    assert page_problems(pool, index, pins) == [f"index entry {entry.hex()} on free page {held[0]}"]


def test_engine_audit_covers_the_pd_buffer() -> None:
    """check_invariants on a decoder finds an owner for every PD buffer reference: a
    reservation in a lease is accounted for; a reference nobody owns is reported."""
    cfg = small_config(enable_pd=True, pd_role="receiver", pd_buffer_size="16KiB")
    with Engine(cfg, SMALL_LAYOUT, model_name="m") as engine:
        buffer = engine.receiver_host().pd_buffer
        assert buffer is not None
        res, _ = buffer.reserve("r1", [random_key()], [CONTRACT_CHUNK], timeout=1.0)
        engine.receiver_host().attach_hold("r1", res)
        assert engine.check_invariants() == []
        buffer.pool.retain([res.pages[0]])  # a reference no lease, pin or entry owns
        problems = engine.check_invariants()
        assert any(p.startswith("pd buffer: page") for p in problems), problems
        buffer.pool.release([res.pages[0]])
        engine.end_request("r1")
        assert engine.check_invariants() == []
        assert buffer.pool.free_pages == buffer.num_pages
