"""The page-level Engine API the kvtier server uses: reserve/commit (store without the copy)
and lease_pages (retrieve without the copy), for a writer or reader that maps the pages."""

from __future__ import annotations

import pytest
import torch

from kvtier import Engine, StateError
from kvtier.storage.cpu import CpuTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config


def page_view(engine: Engine, page: int, num_tokens: int) -> torch.Tensor:
    cpu = engine.tier("cpu")
    assert isinstance(cpu, CpuTier)
    raw = cpu.pool.page_bytes_view(page, num_tokens * SMALL_LAYOUT.token_bytes())
    return raw.view(SMALL_LAYOUT.dtype).view(SMALL_LAYOUT.kv_shape(num_tokens))


def test_reserve_fill_commit_then_lease_pages_read_back() -> None:
    tokens, kv = make_tokens(50, 1), make_kv(50, 1)
    with Engine(small_config(), SMALL_LAYOUT, model_name="pages") as engine:
        slots = engine.pages().reserve_pages(tokens, "w", skip_leading_tokens=16)
        assert [s.span.start for s in slots] == [16, 32]  # whole chunks after the skip
        assert engine.lookup(tokens, "early").tokens == 0  # reserved pages are not visible yet
        engine.end_request("early")
        for slot in slots:
            span = slot.span
            page_view(engine, slot.page, span.num_tokens).copy_(kv[:, :, span.start : span.end])
        assert engine.pages().commit_pages("w", slots) == 2
        assert engine.stats()["open_requests"] == 0  # commit ended the writer's request
        engine.store(tokens, kv)  # chunk 0, the one the writer skipped

        end, held = engine.pages().lease_pages(tokens, "r")
        assert end == 48 and [(start, n) for _, start, n in held] == [(0, 16), (16, 16), (32, 16)]
        assert engine.stats()["pinned_pages"] == 3  # held until end_request
        for page, start, n in held:
            assert torch.equal(page_view(engine, page, n), kv[:, :, start : start + n])
        end, held = engine.pages().lease_pages(tokens, "r", skip_leading_tokens=20)
        assert end == 48 and [start for _, start, _ in held] == [16, 32]
        assert engine.end_request("r")
        assert engine.check_invariants() == []


def test_ending_a_reservation_gives_its_pages_back_unstored() -> None:
    tokens = make_tokens(64, 2)
    with Engine(small_config(cpu_chunks=4), SMALL_LAYOUT, model_name="pages") as engine:
        slots = engine.pages().reserve_pages(tokens, "w")
        assert len(slots) == 4 and engine.stats()["allocator"]["pages_free"] == 0
        assert engine.check_invariants() == []  # the lease owns them
        assert engine.end_request("w")
        assert engine.stats()["allocator"]["pages_free"] == 4
        with pytest.raises(StateError, match="no reservation"):
            engine.pages().commit_pages("w", slots)  # too late: nothing is published
        assert engine.lookup(tokens, "r").tokens == 0
        engine.end_request("r")
        assert engine.check_invariants() == []
