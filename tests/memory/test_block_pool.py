from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvtier import ConfigError
from kvtier.memory import BlockPool, pages_for_capacity


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = BlockPool(4, 8192)
    yield p
    p.close()


def test_buffer_is_page_aligned(pool: BlockPool) -> None:
    assert pool.base_address % 4096 == 0
    assert pool.page_bytes_view(1).data_ptr() == pool.base_address + 8192


def test_allocate_is_all_or_nothing(pool: BlockPool) -> None:
    first = pool.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert pool.allocate(2) is None
    assert pool.free_pages == 1
    pool.release(first)
    assert pool.free_pages == 4


def test_release_below_zero_is_refused_loudly(pool: BlockPool) -> None:
    (page,) = pool.allocate(1) or []
    pool.release([page])
    with pytest.raises(AssertionError, match="double release"):
        pool.release([page])
    assert pool.refcount(page) == 0 and pool.free_pages == 4


def test_retain_keeps_a_page_until_the_last_release(pool: BlockPool) -> None:
    (page,) = pool.allocate(1) or []
    pool.retain([page, page])
    assert pool.refcount(page) == 3
    pool.release([page, page])
    assert pool.free_pages == 3
    pool.release([page])
    assert pool.free_pages == 4
    with pytest.raises(AssertionError, match="free page"):
        pool.retain([page])


@pytest.mark.parametrize(
    ("capacity", "chunk", "pages"),
    [
        (10 * 4096, 4096, 10),
        (10 * 4096 + 4095, 4096, 10),
        (4096, 4096, 1),
        (33554432 * 3 - 1, 33554432, 2),
    ],
)
def test_capacity_is_a_ceiling_rounded_down(capacity: int, chunk: int, pages: int) -> None:
    assert pages_for_capacity("max_local_cpu_size", capacity, chunk) == pages


def test_capacity_cut_is_logged_once_with_the_figures(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.memory.block_pool"):
        pages_for_capacity("pd_buffer_size", 5000, 4096)
        pages_for_capacity("pd_buffer_size", 8192, 4096)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert (
        "asked 5000 bytes, using 4096 bytes (1 chunks of 4096 bytes; 904 bytes unused)"
        in messages[0]
    )


def test_below_one_chunk_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        pages_for_capacity("pd_buffer_size", 4095, 4096)
    assert info.value.key == "pd_buffer_size" and "at least one chunk (4096 bytes" in str(
        info.value
    )


def test_a_view_that_outlives_its_pool_never_touches_other_memory() -> None:
    """torch.frombuffer keeps no buffer export, so unmapping at close would leave views
    (a transfer thread still receiving, a write still landing) pointing at memory the next
    pool may be mapped at. Run in a subprocess: the bug was a crash or silent corruption."""
    import subprocess
    import sys

    code = """
import torch
from kvtier.memory import BlockPool
stale = []
for round in range(20):
    old = BlockPool(64, 65536)
    stale.append(old.page_bytes_view(3))
    old.close()
    new = BlockPool(64, 65536)
    new.buffer.fill_(0)
    for view in stale:
        view.fill_(255)  # a late write through a view of a closed pool
    assert int(new.buffer.max()) == 0, f"round {round}: a stale view wrote into a new pool"
    new.close()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        done.returncode,
        done.stderr[-500:],
    )
