"""A tenant's reuse watch: its guarantee lapses after a guarantee's worth of chunks lost
unused in a row, and the first chunk that comes back (hit while held, or stored again from
the ghost list) restores it."""

from __future__ import annotations

import hashlib

from kvtier.keys import ChunkKey
from kvtier.storage.tenants.reuse import MIN_WINDOW, ReuseWatch


def key(n: int) -> ChunkKey:
    return hashlib.blake2b(n.to_bytes(8, "big"), digest_size=16).digest()


def lose_unused(watch: ReuseWatch, first: int, count: int) -> None:
    for n in range(first, first + count):
        watch.stored(key(n))
        watch.lost(key(n))


def test_a_window_of_unused_losses_lapses_the_guarantee() -> None:
    watch = ReuseWatch()
    watch.resize(4)  # a tiny guarantee still waits for MIN_WINDOW losses
    assert watch.window == MIN_WINDOW
    lose_unused(watch, 0, MIN_WINDOW - 1)
    assert not watch.lapsed
    lose_unused(watch, 100, 1)
    assert watch.lapsed


def test_a_lost_chunk_that_was_hit_restores_it() -> None:
    watch = ReuseWatch()
    lose_unused(watch, 0, MIN_WINDOW)
    assert watch.lapsed
    watch.stored(key(500))
    watch.hit(key(500))
    assert watch.used_held == 1
    watch.lost(key(500))
    assert not watch.lapsed and watch.used_held == 0


def test_a_lost_chunk_stored_again_restores_it_and_old_ghosts_are_forgotten() -> None:
    watch = ReuseWatch()
    lose_unused(watch, 0, MIN_WINDOW * 2)  # the ghost list keeps only the last window
    assert watch.lapsed
    watch.stored(key(0))  # lost too long ago: no longer a ghost, says nothing
    assert watch.lapsed
    watch.stored(key(MIN_WINDOW * 2 - 1))  # lost last: it came back
    assert not watch.lapsed


def test_hits_on_a_hot_chunk_do_not_keep_a_scanner_armed() -> None:
    """A scanner's shared system prompt is hit on every scan; the documents beside it are
    lost unused, and that is what lapses it."""
    watch = ReuseWatch()
    watch.stored(key(10**6))
    for n in range(MIN_WINDOW):
        watch.hit(key(10**6))
        lose_unused(watch, n, 1)
    assert watch.lapsed and watch.used_held == 1


def test_a_removed_chunk_says_nothing_of_reuse() -> None:
    watch = ReuseWatch()
    lose_unused(watch, 0, MIN_WINDOW - 1)
    watch.stored(key(900))
    watch.hit(key(900))
    watch.removed(key(900))  # deleted (clear, corrupt), not evicted: no reset, no leak
    assert watch.used_held == 0 and watch.lost_unused == MIN_WINDOW - 1
